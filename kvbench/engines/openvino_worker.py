"""OpenVINO GenAI's side of engine=openvino, run in .venv-openvino (`python -m kvbench.engines.openvino_worker`).

One ContinuousBatchingPipeline per distinct set of knobs (KV precision, eviction config), made on first use: the
precision and the eviction config are fixed when a pipeline compiles. A request is stepped by hand (add_request,
step) so the cache's block usage is read after every step: the pipeline frees a finished sequence's blocks, and its
eviction happens between decode steps, so the usage before the request ends is what the sequence holds.
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import openvino as ov
import openvino_genai as genai

from kvbench.engines.protocol import peak_rss_bytes, reset_peak_rss, serve_worker, worker_op

MAX_PIPELINES = 2  # compiled pipelines kept (each holds its own KV blocks)


def eviction_config(eviction: dict) -> genai.CacheEvictionConfig:
    """OpenVINO's cache eviction from the option's `cache_eviction` knobs (kvbench.engines.openvino), KVCrush's
    representative tokens beside it when the option gives them a budget."""
    crush = None
    if eviction.get("kvcrush_budget"):
        crush = genai.KVCrushConfig(int(eviction["kvcrush_budget"]), genai.KVCrushAnchorPointMode.RANDOM, 0)
    return genai.CacheEvictionConfig(
        int(eviction["start_size"]),
        int(eviction["recent_size"]),
        int(eviction["max_cache_size"]),
        getattr(genai.AggregationMode, eviction["aggregation_mode"]),
        apply_rotation=bool(eviction.get("apply_rotation", False)),
        snapkv_window_size=int(eviction.get("snapkv_window_size", 8)),
        kvcrush_config=crush,
    )


class OpenvinoWorker:
    def __init__(self) -> None:
        self.model_dir = ""
        self.inference_precision = "f32"
        self.kv_blocks = 0
        self.threads = 1
        self.pipelines: dict[str, genai.ContinuousBatchingPipeline] = {}
        self.next_id = 0

    def close(self) -> dict:
        self.pipelines.clear()
        return {}

    def start(self, model_dir: str, inference_precision: str, kv_blocks: int, threads: int) -> dict:
        self.model_dir, self.inference_precision, self.kv_blocks = model_dir, inference_precision, kv_blocks
        self.threads = threads
        return {"engine_version": genai.get_version()}

    def pipeline(self, knobs: dict) -> genai.ContinuousBatchingPipeline:
        key = json.dumps(knobs, sort_keys=True)
        if key in self.pipelines:
            return self.pipelines[key]
        while len(self.pipelines) >= MAX_PIPELINES:
            self.pipelines.pop(next(iter(self.pipelines)))
        # a fixed KV space (usage % x blocks = the blocks held), the whole prompt in one prefill step
        self.pipelines[key] = build_pipeline(self, knobs, self.kv_blocks, prefix_caching=False, whole_prompt=True)
        return self.pipelines[key]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int], knobs: dict) -> dict:
        try:
            return self._generate(self.pipeline(knobs), prompt_ids, max_new_tokens, stop_ids)
        except Exception as error:
            self.pipelines.pop(json.dumps(knobs, sort_keys=True), None)  # a failed step leaves its blocks leaked
            first = (str(error).strip().splitlines() or [""])[0]
            raise RuntimeError(re.sub(r" at /\S+:\d+:?$", "", first)) from None  # a C++ check's source location

    def _generate(self, pipe, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> dict:
        config = genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        config.ignore_eos = False  # ignore_eos=True would ignore stop_token_ids too
        config.stop_token_ids = set(stop_ids)  # kvbench's end-of-turn ids (the model's eos among them)
        ids = ov.Tensor(np.array([prompt_ids], dtype=np.int64))  # (1, T)
        reset_peak_rss()
        self.next_id += 1
        handle = pipe.add_request(self.next_id, ids, config)
        tokens: list[int] = []
        usage: list[float] = []  # % of kv_blocks after each step
        start = time.perf_counter()
        first = 0.0
        while handle.get_status() == genai.GenerationStatus.RUNNING:
            pipe.step()
            usage.append(pipe.get_metrics().cache_usage)
            if handle.can_read():
                for out in handle.read().values():
                    tokens += list(out.generated_ids)
            if tokens and not first:
                first = time.perf_counter()
        end = time.perf_counter()
        if handle.get_status() != genai.GenerationStatus.FINISHED:
            raise RuntimeError(f"request ended {handle.get_status().name}")
        metrics = pipe.get_metrics()
        blocks = [round(u / 100 * self.kv_blocks) for u in usage]
        return {
            "token_ids": tokens,
            "prefill_s": first - start,
            "decode_s": end - first,
            "decode_steps": max(len(tokens) - 1, 0),
            "blocks_held": blocks[-1],  # at the last step, before the finished sequence is freed
            "blocks_peak": max(blocks),
            "engine_block_bytes": metrics.kv_cache_size_in_bytes // self.kv_blocks,
            "peak_mem_bytes": peak_rss_bytes(),
        }


def build_pipeline(
    worker: OpenvinoWorker, knobs: dict, kv_blocks: int, prefix_caching: bool, whole_prompt: bool = False
) -> genai.ContinuousBatchingPipeline:
    """A pipeline over `kv_blocks` blocks of KV, prefix caching on or off, the option's KV precision and eviction.
    whole_prompt: the prompt in one prefill step (a run's examples); else the engine's own scheduler defaults
    (chunked prefill: dynamic_split_fuse, max_num_batched_tokens), as a served trace has them."""
    scheduler = genai.SchedulerConfig()
    scheduler.num_kv_blocks = kv_blocks
    scheduler.cache_size = 0
    scheduler.enable_prefix_caching = prefix_caching
    if whole_prompt:
        scheduler.max_num_batched_tokens = 1 << 16
        scheduler.dynamic_split_fuse = True
    eviction = knobs.get("cache_eviction")
    if eviction:
        scheduler.use_cache_eviction = True
        scheduler.cache_eviction_config = eviction_config(eviction)
    properties = {
        "INFERENCE_PRECISION_HINT": worker.inference_precision,
        "KV_CACHE_PRECISION": knobs.get("kv_cache_precision", worker.inference_precision),
        "INFERENCE_NUM_THREADS": worker.threads,
    }
    return genai.ContinuousBatchingPipeline(worker.model_dir, scheduler, "CPU", properties)


@worker_op("block_bytes")
def block_bytes(worker: OpenvinoWorker, knobs: dict, kv_blocks: int = 8) -> dict:
    """The engine's bytes per KV block at the option's precision, scales and zero points included (u8/u4 add them
    per token and head): kv_cache_size_in_bytes of a pipeline over `kv_blocks` blocks, once one token has run (the
    cache is allocated at the first step)."""
    pipe = build_pipeline(worker, knobs, kv_blocks, prefix_caching=False)
    config = genai.GenerationConfig()
    config.max_new_tokens = 1
    config.do_sample = False
    handle = pipe.add_request(0, ov.Tensor(np.array([[1]], dtype=np.int64)), config)  # (1, 1)
    while handle.get_status() == genai.GenerationStatus.RUNNING:
        pipe.step()
    if handle.get_status() != genai.GenerationStatus.FINISHED:
        raise RuntimeError(f"the one-token probe ended {handle.get_status().name}")
    return {"engine_block_bytes": pipe.get_metrics().kv_cache_size_in_bytes // kv_blocks}


@worker_op("serve_trace")
def serve_trace(
    worker: OpenvinoWorker,
    requests: list[dict],
    stop_ids: list[int],
    knobs: dict,
    kv_blocks: int,
    prefix_caching: bool = False,
    sequential: bool = False,
) -> dict:
    """A request trace through the ContinuousBatchingPipeline's own scheduler within `kv_blocks` blocks
    (kvbench.engines.trace_driver). After each step the pipeline tells its block usage and how many requests it
    scheduled; it does not say which, nor its preemptions or prefix-cache hits (those stay unknown)."""
    from typing import Any

    from kvbench.engines.trace_driver import drive

    pipe = build_pipeline(worker, knobs, kv_blocks, prefix_caching)
    handles: dict[int, Any] = {}

    def add(r: dict) -> None:
        config = genai.GenerationConfig()
        config.max_new_tokens = int(r["max_new_tokens"])
        config.do_sample = False
        config.ignore_eos = False  # ignore_eos=True would ignore stop_token_ids too
        config.stop_token_ids = set(stop_ids)
        ids = ov.Tensor(np.array([r["prompt_ids"]], dtype=np.int64))  # (1, T)
        handles[int(r["id"])] = pipe.add_request(int(r["id"]), ids, config)

    def step() -> list:
        pipe.step()
        events = []
        for rid, handle in list(handles.items()):
            new: list[int] = []
            if handle.can_read():
                for out in handle.read().values():
                    new += list(out.generated_ids)
            status = handle.get_status()
            done = "" if status == genai.GenerationStatus.RUNNING else status.name
            if done:
                handles.pop(rid)
            if new or done:
                events.append((rid, new, done))
        return events

    def sample() -> dict:
        metrics = pipe.get_metrics()
        return {
            "running": None,
            "kv_blocks": round(metrics.cache_usage / 100 * kv_blocks),
            "concurrency": int(metrics.scheduled_requests),
        }

    reset_peak_rss()
    out = drive(requests, add, step, pipe.has_non_finished_requests, sample, sequential)
    return {
        **out,
        "engine_block_bytes": pipe.get_metrics().kv_cache_size_in_bytes // kv_blocks,
        "peak_mem_bytes": peak_rss_bytes(),
    }


def main() -> None:
    serve_worker(OpenvinoWorker())


if __name__ == "__main__":
    main()
