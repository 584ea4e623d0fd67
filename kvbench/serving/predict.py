"""The capacity planner's figures for a serving run (kvbench.plan.model.plan_point): the same model, method, budget
and KV budget. The planner's device memory is set to the weights + the KV budget (headroom 0), so its `max_batch`
is the requests whose compressed cache fits the budget at the trace's mean context (prompt + output: a request's
cache at its last token); its tokens/s is the decode roofline at min(that batch, the trace's requests) on the
`serving.hardware` preset (`cpu`: this machine, calibrated once). Not modelled by the planner, so the measured
figures differ by them: a prompt's uncompressed K/V held while it prefills (compression comes after), prefill
time (a request's prefill stalls the batch's decode), per-step overheads (on a CPU they dominate a 135M model).
"""

from __future__ import annotations

from dataclasses import replace


def predicted(arch, hardware, method, budget, dtype, kv_budget: int, context: int, requests: int) -> dict:
    from kvbench.plan.model import element_bytes, plan_point

    weights = arch.n_params * element_bytes(dtype)
    hw = replace(hardware, memory_bytes=weights + int(kv_budget))
    fit = plan_point(arch, hw, method, budget, dtype, context, 1, 0.0)
    batch = max(1, min(int(fit["max_batch"]), requests))
    at = plan_point(arch, hw, method, budget, dtype, context, batch, 0.0, limits=False)
    return {
        "predicted_max_concurrency": int(fit["max_batch"]),
        "predicted_tokens_s": float(at["decode_tokens_per_s_bound"]),
        "predicted_kv_bytes_per_request": int(fit["kv_bytes_per_request"]),
        "predicted_context": context,
    }
