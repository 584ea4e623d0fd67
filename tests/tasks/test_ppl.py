"""Streaming perplexity: full cache ≡ one-shot perplexity; bounded caches stay bounded."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.native.streaming import stream_perplexity
from kvbench.run.runner import run
from tests.conftest import compose_config


def test_full_cache_stream_equals_one_forward(tiny, tiny_engine, prompt_ids):
    ids = prompt_ids[:300]
    windows = stream_perplexity(tiny_engine, build_method("full"), None, ids, chunk=64)
    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([ids])).logits[0].float()
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum")
    assert sum(w.n_predicted for w in windows) == len(ids) - 1
    assert sum(w.nll_sum for w in windows) == pytest.approx(float(nll), rel=1e-4)
    assert [w.tokens_seen for w in windows] == [64, 128, 192, 256, 300]


@pytest.mark.parametrize("name", ["streamingllm", "snapkv", "h2o", "random"])
def test_bounded_methods_hold_their_budget(tiny_engine, prompt_ids, name):
    params = {"window_size": 16} if name == "snapkv" else {}
    windows = stream_perplexity(tiny_engine, build_method(name, params), Budget.parse(100), prompt_ids[:400], 64)
    assert [w.cache_tokens for w in windows] == [64, 100, 100, 100, 100, 100, 100]
    assert windows[-1].kv_bytes == 2 * 4 * 2 * 16 * 100 * 4
    assert all(math.isfinite(w.perplexity) for w in windows)


def test_rolling_streamingllm_stays_within_its_positions(tiny_engine, prompt_ids):
    method = build_method("streamingllm", {"positions": "rolling"})
    windows = stream_perplexity(tiny_engine, method, Budget.parse(100), prompt_ids[:400], 64)
    assert windows[-1].cache_tokens == 100 and all(math.isfinite(w.perplexity) for w in windows)


def test_pyramidkv_streaming_is_refused_with_the_reason(tiny_engine, prompt_ids):
    with pytest.raises(KvbenchError, match="different number of tokens per layer"):
        stream_perplexity(
            tiny_engine, build_method("pyramidkv", {"window_size": 16}), Budget.parse(100), prompt_ids[:400], 128
        )


def test_ppl_task_end_to_end(tmp_path):
    cfg = compose_config(
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 's'}",
        "task=ppl",
        "task.length=600",
        "task.chunk=128",
        "budget=0.25",
    )
    rows = run(cfg, output_dir=tmp_path / "out")
    assert len(rows) == 2 * 5  # (full + streamingllm) × 5 windows
    assert (rows.metric == "perplexity").all() and rows.score.gt(1).all()
    bounded = rows[rows.method == "streamingllm"].sort_values("window")
    assert bounded.cache_tokens.tolist() == [128, 150, 150, 150, 150]
    again = run(cfg, output_dir=tmp_path / "out2")
    assert again.reused.all()
    assert (tmp_path / "out" / "report" / "stream_ppl_prose.png").stat().st_size > 0  # the curve over tokens


def test_head_merging_streams_on_its_converted_model(tiny_engine, prompt_ids):
    from kvbench.methods import build_method

    method = build_method("headmerge", {"kv_heads": 1})
    merged = stream_perplexity(tiny_engine.prepared(method), method, None, prompt_ids[:200], 64)
    full = stream_perplexity(tiny_engine, build_method("full"), None, prompt_ids[:200], 64)
    assert merged[-1].kv_bytes * 2 == merged[-1].kv_bytes_full == full[-1].kv_bytes_full  # 1 of 2 KV heads
    assert merged[-1].nll_sum != full[-1].nll_sum
