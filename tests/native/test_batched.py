"""Batched decoding (kvbench.native.batched): every row equals its batch-1 run (fp32, greedy) — tokens, bytes, steps."""

import copy

import pytest
import torch

from kvbench.methods import Budget, build_method, method_defaults
from kvbench.native.batched import batches, run_batch

TEXTS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Pack my box with five dozen liquor jugs!!!!! ",
    "How vexingly quick daft zebras jump over it. ",
]  # 45 bytes each: equal token counts
CASES = [
    ("full", {}, None),
    ("snapkv", {"window_size": 8}, 0.25),
    ("pyramidkv", {"window_size": 8}, 0.5),
    ("h2o", {}, 0.25),
    ("streamingllm", {}, 64),
    ("kivi", {"group_size": 16, "residual_length": 32}, None),
    ("headmerge", {"kv_heads": 1}, None),
    ("compose", {"stack": ["h2o", "kivi"], "overrides": {"kivi": {"group_size": 16, "residual_length": 16}}}, 0.5),
]


@pytest.fixture(scope="module")
def prompts(tiny):
    out = [tiny.tokenizer(text * 8)["input_ids"] for text in TEXTS]
    assert len({len(p) for p in out}) == 1  # equal lengths: they batch together
    return out


def build(name, params):
    return build_method(name, {**method_defaults(name), **params})


@pytest.mark.parametrize("name,params,budget", CASES, ids=[c[0] for c in CASES])
def test_rows_equal_batch_one(name, params, budget, tiny_engine, prompts):
    budget = Budget.parse(budget) if budget else None
    rows = run_batch(tiny_engine, build(name, params), budget, prompts, max_new_tokens=6, keep_logits=True)
    for prompt, row in zip(prompts, rows):
        alone = tiny_engine.run(build(name, params), budget, prompt, max_new_tokens=6, keep_logits=True)
        assert row.token_ids == alone.token_ids and row.text == alone.text
        assert row.decode_steps == alone.decode_steps
        assert row.kv_bytes == alone.kv_bytes and row.kv_bytes_full == alone.kv_bytes_full
        for a, b in zip(row.logits, alone.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert row.batch_size == len(prompts) and row.decode_tokens_per_s > 0


def test_a_row_that_finishes_early_is_masked_out(tiny_engine):
    full = build("full", {})
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (200,), generator=generator).tolist() for _ in range(3)]  # diverse outputs
    alone = [tiny_engine.run(full, None, p, max_new_tokens=8) for p in prompts]

    # an end-of-sequence token that one row produces before another does: that row stops, the other goes on
    def first(row, token):
        return row.token_ids.index(token) if token in row.token_ids else 99

    stop_token = next(t for a in alone for t in a.token_ids[1:7] if any(first(b, t) > first(a, t) for b in alone))
    engine = copy.copy(tiny_engine)
    engine.eos_ids = tiny_engine.eos_ids | {stop_token}
    engine._prepared = {}  # not the original engine (prepared() caches itself)
    expected = [engine.run(full, None, p, max_new_tokens=8) for p in prompts]
    assert len({e.decode_steps for e in expected}) > 1
    rows = run_batch(engine, full, None, prompts, max_new_tokens=8)
    for row, want in zip(rows, expected):
        assert row.token_ids == want.token_ids and row.decode_steps == want.decode_steps
        assert row.kv_bytes == want.kv_bytes  # bytes at the row's own end, not the batch's
    early, late = min(rows, key=lambda r: r.decode_steps), max(rows, key=lambda r: r.decode_steps)
    assert early.latency_s <= late.latency_s and early.kv_bytes < late.kv_bytes


def test_appended_question_batched(tiny_engine, prompts):
    method, budget = build("snapkv", {"window_size": 8}), Budget.parse(0.25)
    contexts, questions = [p[:300] for p in prompts], [p[300:320] for p in prompts]
    rows = run_batch(tiny_engine, method, budget, contexts, questions, max_new_tokens=5)
    for c, q, row in zip(contexts, questions, rows):
        alone = tiny_engine.run(method, budget, c, q, max_new_tokens=5)
        assert row.token_ids == alone.token_ids and row.kv_bytes == alone.kv_bytes


def test_batches_group_equal_lengths():
    items = [3, 5, 3, 3, 5, 3]
    assert batches(items, 2, key=lambda x: x) == [[3, 3], [3, 3], [5, 5]]


def test_runner_batch_size_rows_equal_batch_one(tmp_path):
    from kvbench.run.runner import run
    from tests.conftest import compose_config, tiny_overrides

    grid = ["grid.method=[snapkv,h2o]", "grid.budget=[0.25]", "task.context_lengths=[500]", "task.depths=[0.2,0.5,0.8]"]
    one = run(compose_config(*tiny_overrides(tmp_path, *grid, "grid_batch=false")), tmp_path / "one")
    three = run(compose_config(*tiny_overrides(tmp_path, *grid, "batch_size=3")), tmp_path / "three")
    assert not three["reused"].any()  # batched rows have their own configuration hash (their timings differ)
    assert set(one["batch_size"]) == {1} and set(three["batch_size"]) == {3}
    assert (three["decode_tokens_per_s"] > 0).all()
    keys = ["method", "example_id"]
    a, b = one.set_index(keys).sort_index(), three.set_index(keys).sort_index()
    assert len(a) == len(b) == 9
    for column in ["prediction", "score", "kv_bytes", "new_tokens", "context_tokens"]:
        assert a[column].tolist() == b[column].tolist(), column


def test_report_section_shows_batched_throughput(tmp_path):
    import pandas as pd

    from kvbench.report.section import Context
    from kvbench.report.sections.batched import throughput

    rows = pd.DataFrame(
        {
            "method": ["full", "full", "snapkv"],
            "budget": [1.0, 1.0, 0.25],
            "batch_size": [1, 4, 4],
            "decode_tokens_per_s": [10.0, 30.0, 40.0],
            "kv_ratio": [1.0, 1.0, 0.25],
            "peak_mem_bytes": [1e9, 2e9, 1.5e9],
            "score": [1.0, 1.0, 0.0],
            "latency_s": [1.0, 2.0, 2.0],
        }
    )
    section = throughput(rows, pd.DataFrame(), Context(tmp_path))
    assert "| full | 1.000 | 4 | 30.000 |" in section.markdown
    nothing_batched = rows[rows.batch_size == 1]
    assert throughput(nothing_batched, pd.DataFrame(), Context(tmp_path)) is None  # no section
