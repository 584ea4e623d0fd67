"""The worker of tests/engines/test_fake_engine.py's fake engine, run as `python -m tests.engines.fake_engine_worker`
as a real engine's worker runs in its venv: the standard library, kvbench.engines.protocol and trace_driver only.

Deterministic: a request's tokens are its prompt read backwards from its end (ids of the prompt: in the vocabulary),
stopping after a stop id; its "timings" are functions of its lengths; its cache holds `elements` K/V elements per
token at `element_bytes` each (the option's knob), every prompt token, or an eviction's `keep` of them, plus each
decode step's token (the last generated token is never written, as in the real engines)."""

from __future__ import annotations

import math
from collections import deque

from kvbench.engines.protocol import peak_rss_bytes, serve_worker, worker_op

VERSION = "0.0.1-fake"


def answer(prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    out: list[int] = []
    for i in range(max_new_tokens):
        out.append(prompt_ids[-1 - i % len(prompt_ids)])
        if out[-1] in stop_ids:
            break
    return out


class FakeWorker:
    def __init__(self) -> None:
        self.elements = 0  # K/V elements one token adds, all layers

    def start(self, elements_per_token: int) -> dict:
        self.elements = int(elements_per_token)
        return {"engine_version": VERSION}

    def generate(self, prompt_ids, max_new_tokens, stop_ids, element_bytes, full_bytes, keep=None) -> dict:
        tokens = answer(prompt_ids, max_new_tokens, stop_ids)
        steps = len(tokens) - 1  # the first token comes with the prefill
        kept = len(prompt_ids) if keep is None else min(int(keep), len(prompt_ids))
        return {
            "token_ids": tokens,
            "prefill_s": 1e-5 * len(prompt_ids),
            "decode_s": 1e-3 * steps,
            "decode_steps": steps,
            "kv_bytes": (kept + steps) * self.elements * element_bytes,
            "kv_bytes_full": (len(prompt_ids) + steps) * self.elements * full_bytes,
            "peak_mem_bytes": peak_rss_bytes(),
            "engine_version": VERSION,
            "extra": {"tokens_held": kept + steps},
        }


class Batching:
    """Continuous batching in `kv_blocks` blocks of `block_tokens`: a waiting request is admitted while its whole
    request's blocks fit beside the running ones' (the first always: the budget check holds one), then every running
    request emits one token per step."""

    def __init__(self, stop_ids: list[int], kv_blocks: int, block_tokens: int) -> None:
        self.stop_ids, self.kv_blocks, self.block_tokens = stop_ids, kv_blocks, block_tokens
        self.waiting: deque = deque()
        self.running: dict[int, tuple[dict, list[int]]] = {}  # id -> (request, its answer)
        self.made: dict[int, int] = {}  # id -> tokens emitted

    def blocks(self, r: dict) -> int:
        return math.ceil((len(r["prompt_ids"]) + r["max_new_tokens"]) / self.block_tokens)

    def held(self) -> int:
        return sum(self.blocks(r) for r, _ in self.running.values())

    def step(self) -> list:
        while self.waiting and (not self.running or self.held() + self.blocks(self.waiting[0]) <= self.kv_blocks):
            r = self.waiting.popleft()
            self.running[r["id"]] = (r, answer(r["prompt_ids"], r["max_new_tokens"], self.stop_ids))
            self.made[r["id"]] = 0
        events = []
        for rid, (_, tokens) in list(self.running.items()):
            self.made[rid] += 1
            done = self.made[rid] == len(tokens)
            events.append((rid, tokens[self.made[rid] - 1 : self.made[rid]], "FINISHED" if done else ""))
        return events

    def sample(self) -> dict:
        blocks = {rid: self.blocks(r) for rid, (r, _) in self.running.items()}
        state = {"running": list(blocks), "kv_blocks": sum(blocks.values()), "concurrency": len(blocks)}
        for rid in [rid for rid, (_, tokens) in self.running.items() if self.made[rid] == len(tokens)]:
            self.running.pop(rid)  # finished this step: its blocks are free for the next
        return {**state, "preemptions": {}, "blocks": blocks, "cached": {}}


@worker_op("serve_trace")
def serve_trace(worker: FakeWorker, requests, stop_ids, kv_blocks, block_tokens, sequential=False) -> dict:
    from kvbench.engines.trace_driver import drive

    engine = Batching(list(stop_ids), int(kv_blocks), int(block_tokens))
    out = drive(requests, engine.waiting.append, engine.step, lambda: bool(engine.waiting or engine.running),
                engine.sample, sequential)  # fmt: skip
    return {**out, "peak_mem_bytes": peak_rss_bytes()}


if __name__ == "__main__":
    serve_worker(FakeWorker())
