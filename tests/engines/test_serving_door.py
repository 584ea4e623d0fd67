"""What each real engine asks its worker when kvbench serves a trace or compares prefix caching (`ServingEngine.serve`,
`serving_refusal`, `serve_prefix`), with the worker stood in by a recorder: no engine venv needed. The requests are
the worker protocol's, so a machine without the engines still checks the kvbench side of every engine's door."""

from __future__ import annotations

import json

import pytest

from kvbench.engines import ENGINES, llamacpp, openvino, vllm
from kvbench.serving.engines import servers

SHAPE = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}  # 64 K/V a token
TRACE = [
    {"id": 0, "arrival_s": 0.0, "prompt_ids": [5] * 40, "max_new_tokens": 4},
    {"id": 1, "arrival_s": 0.5, "prompt_ids": [6] * 70, "max_new_tokens": 4},
]
RECORD = {"requests": [], "samples": [], "steps": 0, "wall_s": 0.0, "idle_skipped_s": 0.0}


class Recorder:
    """A worker that records every request and answers as the engine's worker would, in shape."""

    sent: list = []

    def __init__(self, python, module, what, env=None):
        self.module, self.closed = module, False

    def request(self, op, **fields):
        Recorder.sent.append((self.module.rsplit(".", 1)[-1], op, fields))
        if op == "start":
            return {
                "engine_version": "9.9",
                "block_size": 16,
                "block_bytes": 2048,
                "num_blocks": 8,
                "model_dtype": "float32",
            }
        if op == "block_bytes":
            return {"engine_block_bytes": 3000}
        if op == "generate":  # llama.cpp's reply: an EngineGeneration's fields
            return {"token_ids": [1], "prefill_s": 0.5, "decode_s": 0.0, "decode_steps": 0, "kv_bytes": 1,
                    "kv_bytes_full": 1, "peak_mem_bytes": 1, "engine_version": "9.9",
                    "extra": {"cached_tokens": 40 if fields["reuse_prefix"] else 0}}  # fmt: skip
        return {**RECORD, "block_bytes": 4096, "engine_block_bytes": 3000}

    def close(self):
        self.closed = True


@pytest.fixture
def sent(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPE))
    for module in (vllm, openvino, llamacpp):
        monkeypatch.setattr(module, "Worker", Recorder)
    monkeypatch.setattr(vllm, "hf_model_dir", lambda model_cfg: tmp_path)
    monkeypatch.setattr(openvino.OpenvinoEngine, "converted", lambda self, model_cfg: tmp_path)
    monkeypatch.setattr(llamacpp, "gguf_of", lambda model_cfg, resolve: tmp_path / "model.gguf")
    monkeypatch.setattr(llamacpp.LlamaCpp, "python", property(lambda self: tmp_path / "python"))
    (tmp_path / "python").write_text("")
    Recorder.sent = []
    return Recorder.sent


def test_the_serving_engines_are_the_backends_with_serving_options():
    assert servers() == ["vllm", "openvino"]
    assert ENGINES.get("vllm").serving_need("fp8", 1024, 256, 606) == 608 * 256  # 16-token blocks, a byte each
    assert ENGINES.get("openvino").serving_need("u8", 1024, 256, 609) == 640 * 1024  # 32-token blocks, model dtype


def test_vllm_starts_a_worker_of_the_budgets_kv_space_per_trace(sent):
    backend = vllm.VllmEngine()
    backend.serving_start({"name": "m"}, "float32")
    assert sent == [] and backend.serving_refusal("fp8", None, TRACE) == ""  # nothing starts before a trace
    reply, block = backend.serve("fp8", None, 1_000_000, TRACE, [2])
    (_, op, start), (_, op2, trace) = sent
    assert op == "start" and start["kv_cache_memory_bytes"] == 1_000_000 and start["kv_cache_dtype"] == "fp8"
    assert start["max_model_len"] == 80 and start["enable_prefix_caching"] is False  # 74 + 1 tokens in whole blocks
    assert op2 == "serve_trace" and trace == {"requests": TRACE, "stop_ids": [2]}
    assert block == 4096 and reply["engine_version"] == "9.9" and backend.workers == {}  # closed after the trace


def test_openvino_serves_in_blocks_of_the_options_own_bytes(sent):
    backend = openvino.OpenvinoEngine()
    backend.serving_start({"name": "m"}, "float32")
    assert backend.serving_refusal("sum", 0.25, TRACE) == ""  # no sliding-window layers
    reply, block = backend.serve("u4", None, 100_000, TRACE, [2])
    ops = [(op, fields) for _, op, fields in sent]
    assert ops[0][0] == "start" and ops[1] == ("block_bytes", {"knobs": {"kv_cache_precision": "u4"}})
    assert block == 3000 - 32 * 64 // 2  # the engine counts u4 data at a byte an element: half a byte is held
    assert ops[2][0] == "serve_trace" and ops[2][1]["kv_blocks"] == 100_000 // block
    reply, _ = backend.serve("sum", 0.25, 100_000, TRACE, [2])
    eviction = sent[-1][2]["knobs"]["cache_eviction"]  # from the budget and the longest request: 18 + 4 tokens
    assert eviction["aggregation_mode"] == "SUM" and eviction["max_cache_size"] == 128  # the engine's floor
    assert reply["knobs"] == sent[-1][2]["knobs"] and reply["engine_version"] == "9.9"


def test_prefix_caching_without_then_with_each_engines_cache(sent):
    traces = {"shared_doc": TRACE}
    vllm_replies = vllm.VllmEngine().serve_prefix({"name": "m"}, "float32", traces, [2], 1 << 20)
    starts = [fields for _, op, fields in sent if op == "start"]
    assert [s["enable_prefix_caching"] for s in starts] == [False, True] and starts[0]["max_model_len"] == 80
    assert all(f["sequential"] for _, op, f in sent if op == "serve_trace") and len(vllm_replies["shared_doc"]) == 2
    sent.clear()
    openvino.OpenvinoEngine().serve_prefix({"name": "m"}, "float32", traces, [2], 1 << 20)
    trace_ops = [f for _, op, f in sent if op == "serve_trace"]
    assert [f["prefix_caching"] for f in trace_ops] == [False, True] and trace_ops[0]["kv_blocks"] == 512
    without, with_cache = llamacpp.LlamaCpp().serve_prefix({"name": "m"}, "float32", traces, [2], 1 << 20)["shared_doc"]
    assert [r["cached_tokens"] for r in without["requests"]] == [0, 0]
    assert [r["cached_tokens"] for r in with_cache["requests"]] == [0, 40]  # the first request of a pass starts cold
    assert not ENGINES.get("openvino").tells_hits and ENGINES.get("vllm").tells_hits
