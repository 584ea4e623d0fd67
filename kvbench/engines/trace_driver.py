"""A request trace served inside an engine's worker (standard library only: it runs in the engine's venv).

The engine's own continuous batching does the work; this loop only feeds it and stamps what comes out, on the
same clock as kvbench's scheduler (kvbench.serving.scheduler): wall time from the trace's start, idle gaps (nothing
running, the next request not yet arrived) skipped rather than slept. Before each engine step every request whose
arrival time has passed is added; after it, each request's new tokens are stamped with the time the step returned.
`sequential=True` adds the next request only when the engine is idle, at that moment (requests in order, as a
chat's turns or a prefix-caching comparison need: its TTFT is then its own prefill).

An engine is four callables: `add(request)`, `step() -> [(id, new_token_ids, finished_status or "")]`,
`busy() -> bool`, `sample() -> {"running": [ids] | None, "kv_blocks": int, "concurrency": int,
"preemptions": {id: n}, "blocks": {id: n}, "cached": {id: n}}` (what the engine tells after a step; `running` None
where it does not say which requests it scheduled: their queueing time stays unknown).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


def drive(
    requests: list[dict],
    add: Callable[[dict], None],
    step: Callable[[], list],
    busy: Callable[[], bool],
    sample: Callable[[], dict],
    sequential: bool = False,
) -> dict:
    """Serve `requests` ({"id", "arrival_s", "prompt_ids", "max_new_tokens"}); returns per-request records and the
    run's samples (clock s, KV blocks held, requests scheduled) after every step."""
    nan = math.nan
    records = {
        r["id"]: {
            "id": r["id"],
            "arrival_s": float(r["arrival_s"]),
            "admitted_s": nan,
            "first_token_s": nan,
            "finish_s": nan,
            "emitted_s": [],
            "tokens": [],
            "preemptions": 0,
            "blocks": 0,
            "cached_tokens": 0,
            "status": "",
        }
        for r in requests
    }
    pending = deque(sorted(requests, key=lambda r: (r["arrival_s"], r["id"])))
    start, skipped, steps = time.perf_counter(), 0.0, 0
    samples: list[tuple[float, int, int]] = []

    def now() -> float:
        return time.perf_counter() - start + skipped

    while pending or busy():
        if sequential:
            if pending and not busy():
                r = pending.popleft()
                records[r["id"]]["arrival_s"] = now()  # in order: it arrives when the one before has finished
                add(r)
        else:
            while pending and pending[0]["arrival_s"] <= now():
                add(pending.popleft())
        if not busy():  # idle until the next arrival: skip the gap, do not sleep
            skipped += max(0.0, pending[0]["arrival_s"] - now())
            continue
        before = now()
        events = step()
        steps += 1
        t = now()
        state = sample()
        running = state.get("running")
        for rid in running or ():
            if rid in records and math.isnan(records[rid]["admitted_s"]):
                records[rid]["admitted_s"] = before  # scheduled in this step (its prefill, or its first chunk)
        for rid, new, status in events:
            rec = records[rid]
            if new and math.isnan(rec["first_token_s"]):
                rec["first_token_s"] = t
                if running is not None and math.isnan(rec["admitted_s"]):
                    rec["admitted_s"] = before  # scheduled and finished within this one step
            rec["tokens"] += list(new)
            rec["emitted_s"] += [t] * len(new)
            if status:
                rec["finish_s"], rec["status"] = t, status
        for key, field in (("preemptions", "preemptions"), ("blocks", "blocks"), ("cached", "cached_tokens")):
            for rid, n in (state.get(key) or {}).items():
                if rid in records:
                    records[rid][field] = max(records[rid][field], int(n))
        samples.append((t, int(state.get("kv_blocks", 0)), int(state.get("concurrency", 0))))
    return {
        "requests": [records[r["id"]] for r in requests],
        "samples": samples,
        "steps": steps,
        "wall_s": time.perf_counter() - start,
        "idle_skipped_s": skipped,
    }
