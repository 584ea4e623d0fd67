"""The serving scheduler on the tiny random model: the budget holds at every step, every request finishes, the full
cache's answers are Engine.run's, a smaller budget never reaches more concurrency, preemption when it must."""

from __future__ import annotations

import random

import pytest

from kvbench.methods import Budget, build_method
from kvbench.serving.scheduler import Scheduler
from kvbench.serving.trace import Request, arrivals

TOKEN = 2 * 4 * 2 * 16 * 4  # tiny-random: K+V × 4 layers × 2 KV heads × head_dim 16 × fp32 = 1024 bytes per token


def requests(tiny, n=5, new=6, arrival="burst", rate=1.0) -> list[Request]:
    rng = random.Random(0)
    times = arrivals(n, arrival, rate, 0)
    out = []
    for i in range(n):
        length = rng.randint(60, 140)
        ids = [rng.randrange(0, 256) for _ in range(length)]  # byte tokens
        out.append(Request(i, times[i], ids, [], new))
    return out


KNOBS = {"kivi": {"group_size": 16, "residual_length": 16}}  # head_dim 16


def serve(engine, method: str, budget, kv_budget: int, reqs):
    built = build_method(method, KNOBS.get(method))
    return Scheduler(engine, built, Budget.parse(budget) if budget else None, kv_budget).run(reqs)


@pytest.mark.parametrize(
    "method,budget",
    [("full", None), ("snapkv", 0.25), ("streamingllm", 0.25), ("h2o", 0.25), ("kivi", None), ("adakv", 0.25)],
)
def test_budget_holds_at_every_step_and_every_request_finishes(tiny, tiny_engine, method, budget):
    reqs = requests(tiny)
    kv_budget = 300 * TOKEN  # two or three requests at once
    result = serve(tiny_engine, method, budget, kv_budget, reqs)
    assert result.samples, "no step recorded"
    assert max(held for _, held, _ in result.samples) <= kv_budget
    assert result.peak_held_bytes <= kv_budget
    for s in result.served:
        assert len(s.emitted) == s.request.max_new_tokens or s.emitted[-1] in tiny_engine.eos_ids
        assert s.finish_s >= s.first_token_s >= s.admitted_s >= s.request.arrival_s
    assert result.max_concurrency >= 2  # continuous batching: more than one request decoded at once


@pytest.mark.parametrize("method,budget", [("full", None), ("snapkv", 0.25), ("kivi", None)])
def test_the_padded_peak_is_never_below_the_held_peak(tiny, tiny_engine, method, budget):
    """Both peaks are taken at the same moments with the same transients (a prompt's uncompressed K/V while it is
    prefilled): a compressing method's held peak is that transient, which the padded peak once left out."""
    result = serve(tiny_engine, method, budget, 300 * TOKEN, requests(tiny))
    assert result.peak_padded_bytes >= result.peak_held_bytes > 0


def test_full_cache_answers_equal_engine_run_alone(tiny, tiny_engine):
    reqs = requests(tiny, n=5, new=8)
    result = serve(tiny_engine, "full", None, 400 * TOKEN, reqs)
    assert result.max_concurrency >= 3
    for s in result.served:
        alone = tiny_engine.run(build_method("full"), None, s.request.prompt_ids, max_new_tokens=8)
        assert s.emitted == alone.token_ids  # greedy tokens identical, decoded among other requests
        assert s.kv_bytes == alone.kv_bytes  # its own cache's bytes, not the batch's pads


@pytest.mark.parametrize("method,budget", [("snapkv", 0.25), ("h2o", 0.25)])
def test_compressed_answers_equal_engine_run_alone(tiny, tiny_engine, method, budget):
    reqs = requests(tiny, n=4, new=8)
    result = serve(tiny_engine, method, budget, 10_000 * TOKEN, reqs)
    assert result.max_concurrency == 4
    for s in result.served:
        alone = tiny_engine.run(build_method(method), Budget.parse(budget), s.request.prompt_ids, max_new_tokens=8)
        assert s.emitted == alone.token_ids
        assert s.kv_bytes == alone.kv_bytes


def test_smaller_budget_gives_no_more_concurrency(tiny, tiny_engine):
    reqs = requests(tiny, n=6)
    results = [serve(tiny_engine, "full", None, b * TOKEN, reqs) for b in (160, 300, 600, 2000)]
    reached = [r.max_concurrency for r in results]
    assert reached == sorted(reached) and reached[0] < reached[-1]
    decoding = sum(len(s.emitted) > 1 for s in results[-1].served)  # one whose first token ends it leaves at once
    assert reached[-1] == decoding  # everything at once when it all fits
    assert reached[0] == 1  # one 140-token request at most beside nothing


def test_compression_admits_more_at_the_same_budget(tiny, tiny_engine):
    reqs = requests(tiny, n=6)
    full = serve(tiny_engine, "full", None, 300 * TOKEN, reqs).max_concurrency
    snap = serve(tiny_engine, "snapkv", 0.25, 300 * TOKEN, reqs).max_concurrency
    assert snap > full


def test_preemption_when_the_running_requests_outgrow_the_budget(tiny, tiny_engine):
    # short prompts admitted together, then long outputs: the growth cannot fit, the newest is preempted
    reqs = [Request(i, 0.0, list(range(10 + i, 30 + i)), [], 40) for i in range(3)]
    kv_budget = 80 * TOKEN  # all three prompts fit (3 × 21 + 3), not three caches of 60 tokens
    result = serve(tiny_engine, "full", None, kv_budget, reqs)
    preempted = sum(s.preemptions for s in result.served)
    assert 1 <= preempted <= 4  # the newest goes first; no admit-preempt loop (admission waits for a finish)
    assert result.served[0].preemptions == 0  # the oldest always runs on
    assert max(held for _, held, _ in result.samples) <= kv_budget
    for s in result.served:  # recomputed from the prompt: the same greedy tokens as alone, none sent twice
        alone = tiny_engine.run(build_method("full"), None, s.request.prompt_ids, max_new_tokens=40)
        assert s.emitted == alone.token_ids
        assert s.recompute_mismatches == 0
    assert any(s.recomputed_tokens > 0 for s in result.served)


def test_no_preemption_when_everything_fits(tiny, tiny_engine):
    reqs = [Request(i, 0.0, list(range(10 + i, 30 + i)), [], 40) for i in range(3)]
    result = serve(tiny_engine, "full", None, 400 * TOKEN, reqs)
    assert sum(s.preemptions for s in result.served) == 0 and result.max_concurrency == 3


def test_poisson_arrivals_wait_for_their_time(tiny, tiny_engine):
    reqs = requests(tiny, n=4, arrival="poisson", rate=0.5)  # gaps of ~2 s: idle time is skipped, not slept
    result = serve(tiny_engine, "full", None, 10_000 * TOKEN, reqs)
    for s in result.served:
        assert s.admitted_s >= s.request.arrival_s
    assert result.idle_skipped_s > 0
    assert result.wall_s < result.duration_s  # the gaps were skipped
