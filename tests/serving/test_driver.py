"""The engines' trace loop (kvbench.engines.trace_driver) on a scripted engine: arrivals on the trace's clock,
idle gaps skipped, every step's tokens stamped, requests in order when sequential."""

from __future__ import annotations

import math

from kvbench.engines.trace_driver import drive


class Scripted:
    """Each request needs `steps` engine steps, one token each; at most `slots` run at once (first come)."""

    def __init__(self, slots: int = 2, steps: int = 3):
        self.slots, self.steps = slots, steps
        self.waiting: list[int] = []
        self.running: dict[int, int] = {}
        self.added: list[int] = []

    def add(self, r: dict) -> None:
        self.added.append(r["id"])
        self.waiting.append(r["id"])

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list:
        while self.waiting and len(self.running) < self.slots:
            self.running[self.waiting.pop(0)] = 0
        events = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] == self.steps
            events.append((rid, [100 + rid], "FINISHED" if done else ""))
            if done:
                del self.running[rid]
        return events

    def sample(self) -> dict:
        return {"running": list(self.running), "kv_blocks": len(self.running), "concurrency": len(self.running)}


def requests(arrivals):
    return [{"id": i, "arrival_s": t, "prompt_ids": [1, 2], "max_new_tokens": 3} for i, t in enumerate(arrivals)]


def test_burst_queues_beyond_the_engine_slots():
    engine = Scripted(slots=2, steps=3)
    out = drive(requests([0, 0, 0]), engine.add, engine.step, engine.busy, engine.sample)
    recs = out["requests"]
    assert [r["tokens"] for r in recs] == [[100] * 3, [101] * 3, [102] * 3]
    assert all(r["status"] == "FINISHED" for r in recs)
    assert out["steps"] == 6 and max(c for _, _, c in out["samples"]) == 2
    # the third waited for a slot: admitted after the first two finished, its first token after theirs
    assert recs[2]["admitted_s"] >= recs[0]["finish_s"] > recs[0]["admitted_s"]
    for r in recs:
        assert r["arrival_s"] <= r["admitted_s"] <= r["first_token_s"] <= r["finish_s"]
        assert r["emitted_s"] == sorted(r["emitted_s"]) and len(r["emitted_s"]) == 3


def test_idle_gaps_are_skipped_not_slept():
    engine = Scripted(slots=4, steps=1)
    out = drive(requests([0.0, 500.0]), engine.add, engine.step, engine.busy, engine.sample)
    late = out["requests"][1]
    assert out["idle_skipped_s"] > 499 and out["wall_s"] < 60
    assert 500.0 <= late["first_token_s"] < 500.0 + out["wall_s"]  # on the trace's clock


def test_sequential_adds_each_request_when_the_engine_is_idle():
    engine = Scripted(slots=4, steps=2)
    out = drive(requests([0, 0, 0]), engine.add, engine.step, engine.busy, engine.sample, sequential=True)
    recs = out["requests"]
    assert max(c for _, _, c in out["samples"]) == 1  # one at a time
    assert recs[1]["arrival_s"] >= recs[0]["finish_s"] and recs[2]["arrival_s"] >= recs[1]["finish_s"]


def test_unknown_scheduling_leaves_queueing_unknown():
    engine = Scripted(slots=1, steps=1)

    def sample():
        return {**engine.sample(), "running": None}

    out = drive(requests([0, 0]), engine.add, engine.step, engine.busy, sample)
    assert all(math.isnan(r["admitted_s"]) for r in out["requests"])
    assert all(not math.isnan(r["first_token_s"]) for r in out["requests"])
