"""The same trace served by real engines' continuous batching under the same KV budget (`serving.engines`): vLLM's
CPU build and OpenVINO GenAI's ContinuousBatchingPipeline, each in its own venv and worker process
(kvbench.backends; the worker's `serve_trace` op drives the engine on the trace's clock:
kvbench.backends.trace_driver).

The KV budget becomes the engine's whole KV space: vLLM's `kv_cache_memory_bytes` (its block pool holds
budget // its bytes per block blocks; fp8 blocks are half the size, so twice as many), OpenVINO's `num_kv_blocks` =
budget // (32 tokens × the model's K/V elements per token × the KV precision's bytes). Each engine schedules,
batches, chunks prefills and preempts by its own rules. Rows are kvbench's own (kvbench.serving.metrics), with
`engine` and `method` = `<engine>:<option>`; what an engine does not tell is NaN: OpenVINO's queueing time,
preemptions and per-request blocks; vLLM's are read from its scheduler after every step. Scores: the engine's
greedy ids as text, cut as kvbench cuts its own (Engine.answer_text), scored by the task.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from kvbench import KvbenchError
from kvbench.serving import OutputFailed

# engine -> the options it serves a trace with (its Backend's options)
SERVING_OPTIONS = {"vllm": ("full", "fp8", "fp8_e4m3", "fp8_e5m2"), "openvino": ("full", "u8", "u4", "sum", "norm_sum")}
BLOCK_TOKENS = {"vllm": 16, "openvino": 32}  # the engines' KV blocks on the CPU, in tokens
# bytes per K/V element, for the check that a budget holds one request before any engine starts. None: the model's
# dtype — also for OpenVINO's u8/u4, whose scales and zero points the engine alone knows (an upper bound here; the
# served block count comes from the engine's own block bytes: OpenvinoServer.block_bytes)
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def check_engines(value) -> dict[str, tuple[str, ...]]:
    """`serving.engines`: null, or a list of `<engine>:<option>`, each an option the engine serves a trace with;
    returns {engine: (option, ...)} in the order given."""
    from kvbench.backends.source import venv_python

    if value is None or value == [] or value == {}:
        return {}
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, (list, tuple)) and all(isinstance(v, str) and v.count(":") == 1 for v in value)):
        raise KvbenchError(
            f"serving.engines={value!r} must be a list of <engine>:<option>; use 'serving.engines=[vllm:full,vllm:fp8]'"
        )
    grouped: dict[str, list[str]] = {}
    for entry in value:
        name, option = entry.split(":")
        grouped.setdefault(name, []).append(option)
    out = {}
    for name, options in grouped.items():
        if name not in SERVING_OPTIONS:
            raise KvbenchError(f"serving.engines: {name} is no serving engine; use {' or '.join(SERVING_OPTIONS)}")
        bad = [o for o in options if o not in SERVING_OPTIONS[name]]
        if bad:
            raise KvbenchError(
                f"serving.engines: {name}:{bad[0]} is not an option {name} serves a trace with; use one of "
                + ", ".join(f"{name}:{o}" for o in SERVING_OPTIONS[name])
            )
        venv = {"vllm": ".venv-vllm", "openvino": ".venv-openvino"}[name]
        if not venv_python(venv).exists():
            raise KvbenchError(
                f"serving.engines: {name} needs {venv}: run `make engine-{name}`, or serve without it "
                f"(serving.engines=null: kvbench's own scheduler only)"
            )
        out[name] = tuple(options)
    return out


def engine_need(engine: str, option: str, token_bytes_model: int, elements_per_token: int, tokens: int) -> int:
    """Bytes of the engine's KV space one request of `tokens` tokens needs: whole blocks at the option's
    precision."""
    per_element = KV_BYTES.get(option)
    token = token_bytes_model if per_element is None else elements_per_token * per_element
    return math.ceil(tokens / BLOCK_TOKENS[engine]) * BLOCK_TOKENS[engine] * token


def check_engine_budgets(engines: dict, shape, budgets, prompt: int, output: int) -> None:
    """Every KV budget holds the longest request in each engine's blocks (before any engine starts)."""
    token_bytes = shape.layout.full_bytes(1)
    elements = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim
    for engine, options in engines.items():
        for option in options:
            need = engine_need(engine, option, token_bytes, elements, prompt + output)
            for b in budgets:
                if b < need:
                    raise KvbenchError(
                        f"serving.kv_budget_bytes={b:,} holds not one request in {engine}:{option}'s blocks "
                        f"({prompt:,} prompt + {output} output tokens need {need:,} bytes); use "
                        f"serving.kv_budget_bytes ≥ {need:,}"
                    )


def wire(requests) -> list[dict]:
    """The trace as the workers read it: the whole prompt (context + question, and any appended suffix)."""
    return [
        {
            "id": r.request_id,
            "arrival_s": r.arrival_s,
            "prompt_ids": [*r.prompt_ids, *r.suffix_ids],
            "max_new_tokens": r.max_new_tokens,
        }
        for r in requests
    ]


def result_of(requests, reply: dict, block_bytes: int, knows_queue: bool):
    """A worker's serve_trace reply as the scheduler's ServeResult (kvbench.serving.metrics reads it)."""
    from kvbench.serving.scheduler import Served, ServeResult

    served = []
    for r, rec in zip(requests, reply["requests"]):
        if rec["status"] != "FINISHED":
            raise KvbenchError(f"the engine ended request {r.request_id} {rec['status'] or 'unfinished'}")
        s = Served(r)
        s.admitted_s = rec["admitted_s"] if knows_queue else math.nan
        s.first_token_s, s.finish_s = rec["first_token_s"], rec["finish_s"]
        s.emitted, s.emitted_s = list(rec["tokens"]), list(rec["emitted_s"])
        s.preemptions = rec["preemptions"] if knows_queue else math.nan  # type: ignore[assignment]
        s.kv_bytes = rec["blocks"] * block_bytes if knows_queue else math.nan  # type: ignore[assignment]
        s.prefill_s = math.nan  # inside the engine's steps (chunked, batched with decodes)
        s.recompute_mismatches = 0
        s.decode_mode = "engine"
        served.append(s)
    blocks = [b for _, b, _ in reply["samples"]] or [0]
    return ServeResult(
        served=served,
        samples=[(t, b * block_bytes, c) for t, b, c in reply["samples"]],
        peak_held_bytes=max(blocks) * block_bytes,
        peak_padded_bytes=max(blocks) * block_bytes,
        max_concurrency=max((c for _, _, c in reply["samples"]), default=0),
        decode_steps=reply["steps"],
        duration_s=max(s.finish_s for s in served),
        wall_s=reply["wall_s"],
        idle_skipped_s=reply["idle_skipped_s"],
    )


def serve_vllm(model_cfg: dict, dtype: str, option: str, kv_budget: int, requests, stop_ids, max_len: int, **kw):
    """One vLLM worker with `kv_budget` bytes of KV space serves the trace (prefix caching per `prefix_caching`)."""
    from kvbench.backends.vllm import VllmBackend

    backend = VllmBackend(kv_cache_memory_bytes=int(kv_budget), max_model_len=max_len)
    backend.start(model_cfg, dtype)
    try:
        kv_dtype = backend.options[option].get("kv_cache_dtype", "auto")
        worker, info = backend.worker(kv_dtype, bool(kw.pop("prefix_caching", False)))
        reply = worker.request("serve_trace", requests=wire(requests), stop_ids=list(stop_ids), **kw)
    finally:
        backend.close()
    reply["engine_version"] = info["engine_version"]
    return reply, int(reply["block_bytes"])


class OpenvinoServer:
    """One OpenVINO worker (the model's IR compiled anew per served trace: each its own block count and knobs)."""

    def __init__(self, model_cfg: dict, dtype: str):
        from kvbench.backends.openvino import OpenvinoBackend

        self.backend = OpenvinoBackend()
        self.blocks: dict[str, int] = {}  # option -> bytes per block (u8/u4: one probe pipeline each)
        try:
            self.backend.start(model_cfg, dtype)
        except BaseException:
            self.backend.close()  # a worker whose start failed would otherwise live on, holding the model
            raise

    def block_bytes(self, option: str) -> int:
        """Bytes of one 32-token block at the option's KV precision: the model dtype's, or for u8/u4 the engine's
        own block (scales and zero points included; u4 data counted at half a byte, as engine=openvino counts it)."""
        from kvbench.backends.openvino import BLOCK, BYTES

        assert self.backend.shape is not None and self.backend.worker is not None
        elements = BLOCK * self.backend.shape.elements_per_token()  # K and V elements of one block, all layers
        precision = self.backend.options[option].get("kv_cache_precision")
        if precision is None:
            return int(elements * BYTES[self.backend.precision])
        if option not in self.blocks:
            engine_block = int(
                self.backend.worker.request("block_bytes", knobs=self.backend.options[option])["engine_block_bytes"]
            )
            if engine_block <= elements // 2:
                raise KvbenchError(f"OpenVINO reported {engine_block} bytes per KV block for {option}: not a block")
            self.blocks[option] = engine_block - (elements // 2 if precision == "u4" else 0)
        return self.blocks[option]

    def refusal(self, option: str, budget: float | None, requests) -> str:
        """Why an eviction option would compute wrong tokens on this model ("" when it would not): OpenVINO evicts
        sliding-window layers too (OpenvinoBackend.sliding_window_break), checked on the longest request."""
        from kvbench.backends.base import EngineRequest

        longest = max(requests, key=lambda r: r.prompt_tokens)
        probe = EngineRequest([0] * longest.prompt_tokens, longest.max_new_tokens, option, budget=budget)
        return self.backend.sliding_window_break(probe, self.backend.knobs(probe))

    def serve(self, option: str, budget: float | None, kv_budget: int, requests, stop_ids, **kw):
        from kvbench.backends.base import EngineRequest

        longest = max(requests, key=lambda r: r.prompt_tokens)
        probe = EngineRequest([0] * longest.prompt_tokens, longest.max_new_tokens, option, budget=budget)
        knobs = self.backend.knobs(probe)  # eviction: max_cache_size from the budget and the longest request
        block = self.block_bytes(option)
        kv_blocks = int(kv_budget) // block
        assert self.backend.worker is not None
        reply = self.backend.worker.request(
            "serve_trace", requests=wire(requests), stop_ids=list(stop_ids), knobs=knobs, kv_blocks=kv_blocks, **kw
        )
        reply["engine_version"] = self.backend.version
        reply["knobs"] = knobs
        return reply, block

    def close(self) -> None:
        self.backend.close()


def serve_engines(
    ctx, engines: dict, requests, kv_budgets, confs, on_served: Callable[..., None] | None = None
) -> tuple[list[tuple[str, str, float, int, Any, dict]], list[str]]:
    """Every engine × option × KV budget: ([(engine, option, budget, kv_budget, ServeResult, reply)], skipped).
    An engine that fails (its model will not convert, its worker dies) keeps the runs it finished and is skipped
    from there with one line, so the other engines and kvbench's own rows are still written; `skipped` holds those
    lines. `ctx`: the serving run's (cfg, lm, engine) — the model config, dtype and stop ids kvbench decodes with.
    `on_served(*run)` is called with each run as it ends (so that it is written before the next one starts)."""
    from kvbench.config.rules import plain

    cfg, lm, engine = ctx
    model_cfg, dtype = dict(plain(cfg.model)), str(lm.dtype).removeprefix("torch.")
    stop_ids = sorted(int(t) for t in engine.eos_ids if isinstance(t, int))
    longest = max(r.prompt_tokens + r.max_new_tokens for r in requests)
    max_len = math.ceil((longest + 1) / BLOCK_TOKENS["vllm"]) * BLOCK_TOKENS["vllm"]
    evict_budget = next((c.budget_value for c in confs if c.budget is not None), 0.25)
    out: list[tuple[str, str, float, int, Any, dict]] = []
    skipped: list[str] = []
    for name, options in engines.items():
        server = None
        option, served = options[0], 0
        try:
            server = OpenvinoServer(model_cfg, dtype) if name == "openvino" else None
            for option in options:
                budget = evict_budget if option in ("sum", "norm_sum") else None
                served = 0  # KV budgets of this option done
                refused = server.refusal(option, budget, requests) if server is not None else ""
                if refused:
                    skipped.append(f"{name}:{option} not served: {refused}")
                    print(f"[serving] {skipped[-1]}", file=sys.stderr, flush=True)
                    continue
                for kv_budget in kv_budgets:
                    print(f"[serving] {name}:{option} at {kv_budget / 1e6:.1f} MB ...", file=sys.stderr, flush=True)
                    if server is not None:
                        reply, block_bytes = server.serve(option, budget, kv_budget, requests, stop_ids)
                    else:
                        reply, block_bytes = serve_vllm(
                            model_cfg, dtype, option, kv_budget, requests, stop_ids, max_len
                        )
                    result = result_of(requests, reply, block_bytes, knows_queue=name == "vllm")
                    out.append((name, option, 1.0 if budget is None else budget, kv_budget, result, reply))
                    served += 1
                    if on_served is not None:
                        on_served(*out[-1])
        except OutputFailed:
            raise
        except KvbenchError as e:
            left = [f"{name}:{o}" for o in options[options.index(option) :]]
            if served:
                left[0] += f" at {len(kv_budgets) - served} of {len(kv_budgets)} KV budgets"
            skipped.append(f"{name} skipped ({', '.join(left)} not served): {e}")
            print(f"[serving] {skipped[-1]}", file=sys.stderr, flush=True)
        finally:
            if server is not None:
                server.close()
    return out, skipped
