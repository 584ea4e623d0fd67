"""The Triton KIVI decode-attention kernel (kvbench/kernels/triton/kivi.py) equals the torch version on the packed groups
(kvbench/kernels/kivi_attention.packed_decode_attention) on real KiviLayer storage: interpreted on CPU, compiled on CUDA.

As in test_quant_kernels.py the interpreted run happens in a child process that sets TRITON_INTERPRET=1 from the
start. Tolerance: both compute in fp32 but sum in different orders (the kernel also dequantizes values in registers
where the torch version folds the value scales into the probabilities, and merges an online softmax across blocks
and splits), so fp32 outputs agree to 2e-6 relative to the largest output element; bf16 outputs are both rounded once
from fp32, hence at most one bf16 step (2^-7 relative) apart.
"""

import types
from pathlib import Path

import pytest
import torch

from kvbench.kernels.kivi_attention import KiviStorage, packed_decode_attention
from kvbench.methods.kivi import KiviLayer
from kvbench.model.cache import layer_select
from tests.conftest import run_interpreted

pytest.importorskip("triton")

# (key_bits, value_bits, query heads per KV head, evicted, head_dim, group_size, residual, dtype, splits)
CASES = [
    (4, 4, 1, False, 16, 8, 16, torch.float32, 1),
    (2, 2, 3, True, 16, 8, 16, torch.float32, 1),  # 8 two-bit codes: half a word per group
    (8, 8, 4, False, 16, 8, 16, torch.float32, 3),  # 3 splits merged
    (4, 2, 4, True, 16, 8, 16, torch.float32, 4),
    (2, 8, 3, False, 16, 8, 16, torch.float32, 2),
    (4, 4, 3, True, 24, 12, 24, torch.float32, 3),  # 12-token groups: 4-slot blocks, 1.5 words per 4-bit group
    (2, 4, 1, False, 24, 12, 24, torch.float32, 1),  # head_dim 24: a masked tail of the 32-wide channel block
    (16, 4, 4, False, 16, 8, 16, torch.float32, 1),  # keys unquantized: every key in the residual
    (4, 16, 3, True, 16, 8, 16, torch.float32, 2),  # values unquantized
    (4, 2, 4, True, 64, 32, 64, torch.bfloat16, 2),
]
IDS = [f"k{c[0]}v{c[1]}-gqa{c[2]}{'-dead' if c[3] else ''}-D{c[4]}g{c[5]}-{str(c[7])[6:]}-s{c[8]}" for c in CASES]

_CHILD = """
import sys, torch
from kvbench.kernels.kivi_attention import KiviStorage
from kvbench.kernels.triton.kivi import triton_kivi_decode_attention
def call(q, storage, kw):
    knobs = KiviStorage(*storage, kw["key_bits"], kw["value_bits"], kw["group_size"], kw["dead"])
    return triton_kivi_decode_attention(q, knobs, kw["scaling"], n_splits=kw["n_splits"])
out = [call(*case) for case in torch.load(sys.argv[1])]
torch.save(out, sys.argv[2])
"""


def _kv(n_tokens, head_dim, n_heads, dtype, seed, batch=2):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, n_heads, n_tokens, head_dim, generator=g) * torch.linspace(0.5, 4, head_dim)
    values = torch.randn(batch, n_heads, n_tokens, head_dim, generator=g) + 1  # (B, H_kv, T, D)
    return keys.to(dtype), values.to(dtype)


def _case(key_bits, value_bits, group, evicted, head_dim, group_size, residual, dtype, splits, seed=0):
    """(query, storage, kwargs) of a real KiviLayer after one decode step's update: 101 slots stored, two heads."""
    keys, values = _kv(100, head_dim, 2, dtype, seed)
    layer = KiviLayer.from_kv(keys, values, 4, group_size, residual, key_bits=key_bits, value_bits=value_bits)
    if evicted:  # head 0 drops slots 0-7 and every 3rd, head 1 the oldest 39: key group 0 freed when G = 8
        head0 = torch.tensor([i for i in range(8, 100) if i % 3])
        index = torch.stack([head0, torch.arange(39, 100)]).expand(2, -1, -1)  # (B, H_kv, 61)
        layer_select(layer, index)
        assert layer.dead is not None
    view, _ = layer.update(*_kv(1, head_dim, 2, dtype, seed + 1))
    query = torch.randn(2, 2 * group, 1, head_dim, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    storage = tuple(view.storage()[:8])
    kwargs = dict(key_bits=key_bits, value_bits=value_bits, group_size=group_size, scaling=head_dim**-0.5,
                  dead=view.dead, n_splits=splits)  # fmt: skip
    return query, storage, kwargs


def _residual_only(dtype=torch.float32):
    """Nothing quantized (a prompt shorter than the residual): every slot read from the residuals."""
    keys, values = _kv(13, 16, 2, dtype, 5)
    layer = KiviLayer.from_kv(keys, values, 4, 8, 16)
    assert layer.key_scale.shape[-1] == 0 and layer.value_scale.shape[2] == 0
    query = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(6)).to(dtype)
    kwargs = dict(key_bits=4, value_bits=4, group_size=8, scaling=0.25, dead=None, n_splits=5)  # 3 empty splits
    return query, tuple(layer.storage()[:8]), kwargs


def _args(storage, kwargs) -> tuple[KiviStorage, float]:
    """A case's (storage, scaling) as the attention functions take them (the case keeps plain tensors and a dict:
    the interpreted child process unpickles them)."""
    return KiviStorage(
        *storage, kwargs["key_bits"], kwargs["value_bits"], kwargs["group_size"], kwargs["dead"]
    ), kwargs["scaling"]


def _reference(query, storage, kwargs):
    return packed_decode_attention(query, *_args(storage, kwargs))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    inputs = [_case(*c) for c in CASES] + [_residual_only()]
    return inputs, run_interpreted(_CHILD, inputs, tmp_path_factory.mktemp("triton_kivi"))


def _assert_matches(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * want.float().abs().max().item())
    else:
        assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("case", range(len(CASES) + 1), ids=IDS + ["residual-only"])
def test_interpreted_kernel_matches_packed_attention(interpreted, case):
    inputs, outputs = interpreted
    query, storage, kwargs = inputs[case]
    want = _reference(query, storage, kwargs)  # (B, 1, H_q, D)
    assert want.shape == (query.shape[0], 1, query.shape[1], query.shape[-1]) and torch.isfinite(want).all()
    _assert_matches(outputs[case], want)


def test_cases_cover_the_storage_edge_cases(interpreted):
    """The inputs really hold what the case names promise: dead slots, freed key groups, empty quantized parts."""
    inputs, _ = interpreted
    for (key_bits, value_bits, _, evicted, *_), (_, storage, kwargs) in zip(CASES, inputs):
        key_scale, value_scale = storage[1], storage[5]  # (B, H_kv, D, N_k), (B, H_kv, T_v, D/G)
        assert (kwargs["dead"] is not None) == evicted
        assert (key_scale.shape[-1] == 0) == (key_bits == 16) and (value_scale.shape[2] == 0) == (value_bits == 16)
    _, storage, kwargs = inputs[1]  # 2-bit, G = 8, evicted: key group 0 is dead in both heads and freed
    assert storage[1].shape[-1] == 11 and kwargs["dead"].shape == (2, 2, 31)  # 100 − 8 stored + 1 new − 62 kept
    assert storage[3].shape[2] % 8 and storage[5].shape[2] % 8  # partial last blocks for keys and values


_GENERATE = """
import sys, torch
from omegaconf import OmegaConf
import kvbench.kernels as kernels
from kvbench.native.engine import Engine
from kvbench.kernels.triton import kivi as triton_kivi
from kvbench.methods import build_method, method_defaults
from kvbench.model.load import load_model
from kvbench.methods.kivi import KiviLayer
conf, prompt, params = torch.load(sys.argv[1])
engine = Engine(load_model(OmegaConf.load(conf), "cpu", "float32"))
method = build_method("kivi", {**method_defaults("kivi"), **params})
runs, calls = {}, []
for path in ("torch", "triton"):
    if path == "triton":  # what the dispatcher does on CUDA, here on CPU tensors under the interpreter
        kernels.fast_module = lambda tensor, module: triton_kivi if module == "kivi" else None
        real = triton_kivi.triton_kivi_decode_attention
        triton_kivi.triton_kivi_decode_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    gen = engine.run(method, None, prompt, max_new_tokens=6, keep_logits=True)
    runs[path] = (gen.token_ids, [l.float() for l in gen.logits], gen.kv_bytes, gen.decode_steps)
torch.save((runs, len(calls)), sys.argv[2])
"""


@pytest.mark.slow
def test_generation_through_the_kernel_equals_the_torch_path(tmp_path, prompt_ids):
    """The kernel plugged into KiviLayer.attend by the dispatcher, on the tiny model (4 layers, GQA 2): the same
    tokens, logits within fp32 rounding, the same bytes as the torch version's generation."""
    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / "tiny-random.yaml"
    params = {"key_bits": 4, "value_bits": 2, "group_size": 16, "residual_length": 32}
    runs, calls = run_interpreted(_GENERATE, (str(conf), prompt_ids[:150], params), tmp_path)
    (tokens, logits, kv_bytes, steps), (t_tokens, t_logits, t_bytes, t_steps) = runs["torch"], runs["triton"]
    assert steps == t_steps == 5 and calls == steps * 4  # every decode step of every layer went through the kernel
    assert t_tokens == tokens and t_bytes == kv_bytes
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(t_logits, logits))


def test_merge_of_splits_equals_one_softmax():
    """merge_splits reassembles softmax(s)·v from per-split partials, a split with nothing live included."""
    from kvbench.kernels.triton.kivi import merge_splits

    scores, values = torch.randn(3, 10) * 4, torch.randn(10, 5)  # (G_q, T), (T, D)
    scores[:, 4:6] = float("-inf")  # split 2 (slots 4-5) is all dead
    bounds = [(0, 4), (4, 6), (6, 10)]
    maxima, denominators, outputs = [], [], []
    for lo, hi in bounds:
        top = scores[:, lo:hi].amax(-1)  # (G_q,)
        weights = torch.exp2(scores[:, lo:hi] - top.clamp_min(-1e30).unsqueeze(-1))  # (G_q, n)
        maxima.append(top), denominators.append(weights.sum(-1)), outputs.append(weights @ values[lo:hi])
    got = merge_splits(torch.stack(maxima), torch.stack(denominators), torch.stack(outputs))  # (G_q, D)
    want = torch.softmax(scores * torch.log(torch.tensor(2.0)), -1) @ values  # exp2 = exp(s·ln 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dispatch_picks_triton_only_on_cuda(monkeypatch):
    """kivi_decode_attention: the torch version off CUDA (whatever KVBENCH_NO_TRITON says; C kernels off here, the CPU's
    C kernel has its own tests in test_kivi_attention.py); the Triton module for a CUDA tensor unless
    KVBENCH_NO_TRITON=1."""
    import kvbench.kernels as kernels
    from kvbench.kernels.triton import kivi as triton_kivi

    query, storage, kwargs = _case(4, 2, 2, True, 16, 8, 16, torch.float32, 1)
    kwargs.pop("n_splits")
    monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    calls = []
    monkeypatch.setattr(triton_kivi, "triton_kivi_decode_attention", lambda *a, **k: calls.append(1))
    for env in ("0", "1"):
        monkeypatch.setenv("KVBENCH_NO_TRITON", env)
        assert torch.equal(
            kernels.kivi_decode_attention(query, *_args(storage, kwargs)), _reference(query, storage, kwargs)
        )
    assert not calls
    on_cuda = types.SimpleNamespace(is_cuda=True)  # what the dispatcher reads of a tensor: where it lives
    monkeypatch.setenv("KVBENCH_NO_TRITON", "0")
    assert kernels.fast_module(on_cuda, "kivi") is triton_kivi and kernels.fast_module(query, "kivi") is None
    monkeypatch.setenv("KVBENCH_NO_TRITON", "1")
    assert kernels.fast_module(on_cuda, "kivi") is None


def test_bench_kernels_parses_its_kivi_options():
    """`python -m kvbench.bench kernels` takes its KIVI options on a CPU-only machine (the GPU run happens when one is
    lent)."""
    from kvbench.bench.common import options
    from kvbench.bench.kernels import OPTIONS

    given = ["bench.kivi=true", "bench.lengths=[4096,32768]", "bench.kivi_bits=[2,4]", "device=cpu"]
    opts, rest = options(given, OPTIONS, "kernels")
    assert opts["kivi"] and opts["lengths"] == [4096, 32768] and opts["kivi_bits"] == [2, 4] and rest == ["device=cpu"]
    assert not options([], OPTIONS, "kernels")[0]["kivi"]


def _nvidia_tool(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


@pytest.mark.skipif(not _nvidia_tool("ptxas").exists(), reason="triton without its bundled ptxas")
@pytest.mark.parametrize("group_q,bits", [(1, 2), (4, 4), (8, 8)])
def test_kernel_compiles_for_the_h200_without_register_spills(group_q, bits, tmp_path):
    """No GPU needed: Triton's frontend, its NVIDIA passes and the bundled ptxas build the kernel for sm_90 (H200)
    with the launch's own block sizes at Llama-3.1-8B's head_dim 128 and KIVI's default group 64 — what the
    interpreter cannot check — and cuobjdump reports no spilled registers (STACK:0)."""
    import inspect
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvbench.kernels.quantize import words_per_group
    from kvbench.kernels.triton.kivi import _block_slots, _kivi_decode_kernel

    constants = dict(KEY_BITS=bits, VALUE_BITS=bits, GROUP=64, KEY_WORDS=words_per_group(bits, 64),
                     VALUE_WORDS=words_per_group(bits, 64), HAS_DEAD=True, BLOCK_T=_block_slots(64, group_q, 128),
                     BLOCK_D=128, BLOCK_Q=group_q)  # fmt: skip
    pointers = dict(kp_ptr="*i32", vp_ptr="*i32", dead_ptr="*i8", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32")
    names = list(inspect.signature(_kivi_decode_kernel.fn).parameters)
    signature = {
        n: "constexpr" if n in constants else pointers.get(n, "*bf16") if n.endswith("_ptr") else "i32" for n in names
    }
    signature["qk_scale"] = "fp32"
    source = ASTSource(_kivi_decode_kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(enable_fp_fusion=True))
    (tmp_path / "kernel.cubin").write_bytes(compiled.asm["cubin"])
    usage = subprocess.run(
        [_nvidia_tool("cuobjdump"), "--dump-resource-usage", tmp_path / "kernel.cubin"], capture_output=True, text=True
    ).stdout
    assert "REG:" in usage and "STACK:0 " in usage, usage


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs CUDA")
def test_compiled_kernel_matches_packed_attention_on_cuda():
    from kvbench.kernels import kivi_decode_attention
    from kvbench.kernels.triton.kivi import triton_kivi_decode_attention

    for query, storage, kwargs in [_case(*c) for c in CASES] + [_residual_only()]:
        query, storage = query.cuda(), tuple(t.cuda() for t in storage)
        kwargs = {**kwargs, "dead": None if kwargs["dead"] is None else kwargs["dead"].cuda()}
        want = _reference(query, storage, kwargs)
        _assert_matches(triton_kivi_decode_attention(query, *_args(storage, kwargs), n_splits=kwargs["n_splits"]), want)
        kwargs.pop("n_splits")
        _assert_matches(kivi_decode_attention(query, *_args(storage, kwargs)), want)  # the dispatch picks the kernel
