"""decode_graph (kvbench/native/graph_decode.py): a configuration's decode as one static step over buffer layers,
captured as a CUDA graph where CUDA is present. The static step runs eagerly on the CPU — what the graph replays —
and must give eager decoding's tokens and kv_bytes on every family it takes; the capture itself is checked only
where CUDA is present (skipped here otherwise, and said so)."""

import pytest
import torch

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
    for name, budget in CONFIGS:
        if refusal(build_method(name), lm.config):
            continue  # refused before a model loads (kvbench.preflight.support)
        eager, static, took = decode_both(lm, name, budget)
        assert took == (plain_model and name != "h2o"), (family, name)
        assert static.token_ids == eager.token_ids and static.decode_steps == eager.decode_steps == NEW - 1
        assert static.kv_bytes == eager.kv_bytes
        for a, b in zip(static.logits, eager.logits):  # another attention kernel (masked, over the buffer)
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


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
    with pytest.raises(KvbenchError, match="decode_graph=true captures CUDA graphs.*use device=cuda"):
        graph_decode.check_setting(True, torch.device("cpu"))
    graph_decode.check_setting(False, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the graph capture runs only on a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_graph_gives_eager_tokens_and_bytes(dtype):
    lm = finish(build("llama-gqa"), byte_tokenizer(), "llama-gqa", torch.device("cuda"), dtype)
    for name, budget in CONFIGS[:3]:
        eager, graph, took = decode_both(lm, name, budget)
        assert took
        assert graph.token_ids == eager.token_ids and graph.kv_bytes == eager.kv_bytes


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
