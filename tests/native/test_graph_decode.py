"""decode_graph (kvbench/native/graph_decode.py): a configuration's decode as one static step over buffer layers,
captured as a CUDA graph where CUDA is present. The static step runs eagerly on the CPU — what the graph replays —
and must give eager decoding's tokens and kv_bytes on every family it takes; the capture itself is checked only
where CUDA is present (skipped here otherwise, and said so)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.model.load import byte_tokenizer, finish
from kvbench.native import graph_decode
from kvbench.native.engine import Engine
from kvbench.preflight.support import refusal
from tests.model.families import FAMILIES, build

PROMPT, NEW = 150, 8
CONFIGS = [("full", None), ("snapkv", 0.5), ("pyramidkv", 0.25), ("h2o", 0.5)]  # h2o evicts while decoding: eager


def decode_both(lm, name: str, budget: float | None):
    """(eager Generation, static-step Generation, whether the static step took it)."""
    ids = torch.randint(3, 300, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    method = build_method(name, method_defaults(name))
    out, took = [], []
    for graphs in (False, True):
        engine = Engine(lm, graphs=graphs)
        prefill = engine.prefill(ids, method.stats_request())
        start = engine.compressed(prefill, method, Budget.parse(budget) if budget else None, [], NEW)
        took.append(graphs and graph_decode.applies(lm, start))
        out.append(engine.decode(start, method, NEW, keep_logits=True))
    return out[0], out[1], took[1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_step_gives_eager_tokens_and_bytes(family):
    lm = finish(build(family), byte_tokenizer(), family, torch.device("cpu"), torch.float32)
    plain_model = all(k.kind == "global" for k in lm.layout.layers) and not lm.layout.is_hybrid
    plain_model = plain_model and family != "falcon"  # its attention reads the cache's K/V itself (transformers 5.2)
    for name, budget in CONFIGS:
        if refusal(build_method(name), lm.config):
            continue  # refused before a model loads (kvbench.preflight.support)
        eager, static, took = decode_both(lm, name, budget)
        assert took == (plain_model and name != "h2o"), (family, name)
        assert static.token_ids == eager.token_ids and static.decode_steps == eager.decode_steps == NEW - 1
        assert static.kv_bytes == eager.kv_bytes
        for a, b in zip(static.logits, eager.logits):  # another attention kernel (masked, over the buffer)
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


class OpNames(TorchDispatchMode):
    """The aten ops a block runs."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


# a host round trip (a tensor's value read into Python, a tensor made from Python data) cannot be captured
HOST_OPS = {"aten._local_scalar_dense.default", "aten.lift_fresh.default", "aten.item.default", "aten.nonzero.default"}


@pytest.mark.parametrize("family", ["llama-gqa", "qwen3", "phi3", "gpt2", "olmo2", "mixtral"])
def test_the_static_step_never_reads_a_tensor_into_python(family):
    lm = finish(build(family), byte_tokenizer(), family, torch.device("cpu"), torch.float32)
    engine, full = Engine(lm, graphs=True), build_method("full")
    start = engine.compressed(engine.prefill(list(range(3, 100)), full.stats_request()), full, None, [], NEW)
    assert graph_decode.applies(lm, start)
    step = graph_decode.GraphStep(lm, start, NEW)
    step(5)  # the first step makes the logits buffer
    with OpNames() as ops:
        step(6)  # what a capture records
    assert "aten.scaled_dot_product_attention.default" in ops.names and not ops.names & HOST_OPS


def test_buffer_layer_writes_the_steps_slot_and_masks_the_rest():
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)  # (1, H_kv, T, D)
    step = torch.zeros(1, dtype=torch.long)
    layer = graph_decode.BufferLayer(keys, values, capacity=8, step=step)
    new = torch.randn(1, 2, 1, 4)
    k, _ = layer.update(new, new)
    assert torch.equal(k.tensor[:, :, :5], keys) and torch.equal(k.tensor[:, :, 5:6], new)
    assert k.mask.tolist() == [[[[True] * 6 + [False] * 2]]] and k.zero_pads and not k.tensor[:, :, 6:].any()
    step.add_(1)
    k, _ = layer.update(new * 2, new * 2)
    assert torch.equal(k.tensor[:, :, 6:7], new * 2) and k.mask.sum() == 7
    assert torch.equal(layer.exact(2).keys, torch.cat([keys, new, new * 2], 2))


def test_decode_graph_is_refused_off_cuda():
    with pytest.raises(KvbenchError, match=r"decode_graph=true captures CUDA graphs.*use device=cuda"):
        graph_decode.check_setting(True, torch.device("cpu"))
    graph_decode.check_setting(False, torch.device("cpu"))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the graph capture runs only on a GPU")


def static_logits(lm, start, capture: bool, tokens: list[int] | None = None):
    """Each step's logits through GraphStep fed `tokens` (default: greedy), the tokens fed, and whether it replayed
    a captured graph."""
    step = graph_decode.GraphStep(lm, start, NEW, capture=capture)
    fed, out = [int(start.logits.argmax())], []
    for i in range(NEW - 1):
        token = tokens[i] if tokens is not None else fed[-1]
        out.append(step(token).clone())
        fed.append(int(out[-1].argmax()))
    return out, fed[:-1], step.graph is not None


@CUDA
def test_captured_graph_gives_eager_tokens_and_bytes():
    lm = finish(build("llama-gqa"), byte_tokenizer(), "llama-gqa", torch.device("cuda"), torch.float32)
    for name, budget in CONFIGS[:3]:
        eager, graph, took = decode_both(lm, name, budget)
        assert took
        assert graph.token_ids == eager.token_ids and graph.kv_bytes == eager.kv_bytes


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replayed_graph_gives_its_static_steps_logits(dtype):
    lm = finish(build("llama-gqa"), byte_tokenizer(), "llama-gqa", torch.device("cuda"), dtype)
    engine, method = Engine(lm), build_method("snapkv", method_defaults("snapkv"))
    ids = list(range(3, 160))
    runs, tokens = [], None
    for capture in (False, True):  # the same tokens fed to both (bf16's near ties may pick another greedy token)
        start = engine.compressed(engine.prefill(ids, method.stats_request()), method, Budget.parse(0.5), [], NEW)
        logits, tokens, graphed = static_logits(lm, start, capture, tokens)
        runs.append((logits, graphed))
    (eager, replayed), (captured, graphed) = runs
    assert graphed and not replayed
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # cuBLAS may pick another algorithm inside a capture
    for a, b in zip(eager, captured):  # a stale slot, step or position would move them far more
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


def test_a_run_with_decode_graph_on_the_cpu_stops_before_the_model_loads(tmp_path, monkeypatch):
    from kvbench.run.runner import run
    from tests.conftest import compose_config, tiny_overrides

    monkeypatch.setattr("kvbench.run.runner.load_model", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(KvbenchError, match="decode_graph=true captures CUDA graphs"):
        run(compose_config(*tiny_overrides(tmp_path, "decode_graph=true", "device=cpu")), output_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_decode_graph_rows_have_their_own_configuration_hash(tiny, tmp_path):
    from kvbench.config.spec import RunSpec
    from kvbench.preflight.entrance import check_run
    from kvbench.rows.config_hash import hash_configuration
    from tests.conftest import compose_config, tiny_overrides

    hashes = []
    for value in ("false", "true"):
        spec, confs = check_run(compose_config(*tiny_overrides(tmp_path, f"decode_graph={value}")))
        assert isinstance(spec, RunSpec) and spec.decode_graph is (value == "true")
        hashes.append(hash_configuration(confs[0], spec, tiny))
    assert hashes[0] != hashes[1]
