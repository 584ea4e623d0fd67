"""Per-request and per-run serving figures from the scheduler's record (kvbench.serving.scheduler). Torch-free.

Per request: queue_s = admitted − arrival; ttft_s = first token − arrival; tpot_s = (last token − first token) /
(tokens − 1), NaN for one token; latency_s = finish − arrival. Per run: throughput over the trace's duration (first
arrival to last finish, idle gaps skipped), p50/p90/p99 of TTFT and TPOT, goodput = requests meeting both SLOs
(ttft_s ≤ slo_ttft_s and tpot_s ≤ slo_tpot_s; a one-token request meets the TPOT bound) per second.
"""

from __future__ import annotations

import math

import numpy as np

REQUEST_COLUMNS = [
    "request_id",
    "example_id",
    "arrival_s",
    "queue_s",
    "ttft_s",
    "tpot_s",
    "latency_s",
    "prompt_tokens",
    "prefix_tokens",
    "output_tokens",
    "preemptions",
    "recomputed_tokens",
    "recompute_mismatches",
    "prefill_s",
    "kv_bytes",
    "decode_mode",
    "meets_slo",
    "score",
    "prediction",
]


def percentile(values, q: float) -> float:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.percentile(kept, q)) if kept else float("nan")


def meets(ttft: float, tpot: float, slo_ttft: float, slo_tpot: float) -> bool:
    return ttft <= slo_ttft and (math.isnan(tpot) or tpot <= slo_tpot)


def request_row(s, slo_ttft: float, slo_tpot: float, text: str, score: float | None) -> dict:
    r = s.request
    n = len(s.emitted)
    tpot = (s.emitted_s[-1] - s.emitted_s[0]) / (n - 1) if n > 1 else float("nan")
    ttft = s.first_token_s - r.arrival_s
    return {
        "request_id": r.request_id,
        "example_id": r.example_id,
        "arrival_s": r.arrival_s,
        "queue_s": s.admitted_s - r.arrival_s,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "latency_s": s.finish_s - r.arrival_s,
        "prompt_tokens": r.prompt_tokens,
        "prefix_tokens": r.prefix_tokens,
        "output_tokens": n,
        "preemptions": s.preemptions,
        "recomputed_tokens": s.recomputed_tokens,
        "recompute_mismatches": s.recompute_mismatches,
        "prefill_s": s.prefill_s,
        "kv_bytes": s.kv_bytes,
        "decode_mode": s.decode_mode,
        "meets_slo": meets(ttft, tpot, slo_ttft, slo_tpot),
        "score": float("nan") if score is None else float(score),
        "prediction": text,
    }


def run_row(requests: list[dict], result, slo_ttft: float, slo_tpot: float) -> dict:
    """The run's figures from its request rows and the scheduler's ServeResult."""
    first = min(r["arrival_s"] for r in requests)
    duration = result.duration_s - first
    tokens = sum(r["output_tokens"] for r in requests)
    good = sum(bool(r["meets_slo"]) for r in requests)
    out = {
        "requests": len(requests),
        "duration_s": duration,
        "wall_s": result.wall_s,
        "idle_skipped_s": result.idle_skipped_s,
        "output_tokens": tokens,
        "throughput_tokens_s": tokens / duration if duration > 0 else float("nan"),
        "throughput_requests_s": len(requests) / duration if duration > 0 else float("nan"),
        "goodput_requests_s": good / duration if duration > 0 else float("nan"),
        "slo_attainment": good / len(requests),
        "slo_ttft_s": slo_ttft,
        "slo_tpot_s": slo_tpot,
        "peak_kv_bytes": result.peak_held_bytes,
        "peak_kv_bytes_padded": result.peak_padded_bytes,
        "max_concurrency": result.max_concurrency,
        "decode_steps": result.decode_steps,
        "preemptions": sum(r["preemptions"] for r in requests),
        "recompute_mismatches": sum(r["recompute_mismatches"] for r in requests),
        "score": float(np.nanmean([r["score"] for r in requests]))
        if any(not math.isnan(r["score"]) for r in requests)
        else float("nan"),
    }
    for name in ("ttft_s", "tpot_s", "queue_s"):
        for q in (50, 90, 99):
            out[f"{name.removesuffix('_s')}_p{q}_s"] = percentile([r[name] for r in requests], q)
    return out
