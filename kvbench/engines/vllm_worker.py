"""vLLM's side of engine=vllm, run in .venv-vllm (`python -m kvbench.engines.vllm_worker`).

One `vllm.LLM` per worker: its kv_cache_dtype is fixed when the engine starts, so kvbench starts one worker per
dtype. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so its KV cache config (blocks,
bytes per block) is read from the scheduler and the peak RSS of this process is the engine's.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # threads from OMP_NUM_THREADS, not every core

import time

from kvbench.engines.protocol import peak_rss_bytes, reset_peak_rss, serve_worker, worker_op


def group_facts(config) -> list[dict]:
    """Each KV cache group of the engine: its kind (a hybrid model's Mamba / linear-attention layers keep one state per
    request in `mamba` groups, beside the attention groups' blocks), its layers, the bytes one block takes per layer
    (a Mamba state page is padded to the attention page) and, for a state, the bytes its tensors really hold."""
    facts = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        shapes = getattr(spec, "shapes", None)
        state = 0
        if shapes is not None:  # MambaSpec: conv and recurrent state shapes with their dtypes
            for shape, dtype in zip(shapes, spec.dtypes):
                count = 1
                for n in shape:
                    count *= n
                state += count * dtype.itemsize
        facts.append(
            {
                "kind": "mamba" if shapes is not None else "attention",
                "layers": len(group.layer_names),
                "page_bytes": int(spec.page_size_bytes),
                "state_bytes": state,
                "kv_heads": int(getattr(spec, "num_kv_heads", 0) or 0),
                "head_size": int(getattr(spec, "head_size", 0) or 0),
            }
        )
    return facts


def group_blocks(manager, request_id: str, null_id: int) -> list[int]:
    """Blocks the request holds in each KV cache group, null blocks (a Mamba group's placeholders) left out."""
    try:
        return [sum(b != null_id for b in group) for group in manager.get_block_ids(request_id)]
    except (KeyError, AttributeError, IndexError):
        return []


def held_blocks(manager, request_id: str) -> int:
    """Blocks in the request's block table (all KV cache groups); 0 where the manager does not know the id."""
    try:
        return sum(len(group) for group in manager.get_block_ids(request_id))
    except (KeyError, AttributeError, IndexError):
        return 0


class VllmWorker:
    def __init__(self) -> None:
        self.llm: Any = None  # vllm.LLM once started
        self.next_id = 0

    def start(self, model_dir: str, dtype: str, kv_cache_dtype: str, kv_cache_memory_bytes: int, **engine) -> dict:
        import vllm
        from vllm import LLM

        started = time.perf_counter()
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory_bytes=kv_cache_memory_bytes,  # a fixed KV space, whatever the machine's memory
            enforce_eager=True,  # no torch.compile: minutes on 2 cores, and kernels identical per step
            seed=0,
            **engine,  # enable_prefix_caching, max_model_len
        )
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        config = scheduler.kv_cache_manager.kv_cache_config
        total = sum(tensor.size for tensor in config.kv_cache_tensors)
        cache = self.llm.llm_engine.vllm_config.cache_config
        return {
            "engine_version": vllm.__version__,
            "block_size": cache.block_size,
            "num_blocks": config.num_blocks,
            "block_bytes": total // config.num_blocks,  # all layers: the engine's own page size x layers
            "groups": group_facts(config),
            "model_dtype": str(self.llm.llm_engine.vllm_config.model_config.dtype).replace("torch.", ""),
            "start_s": time.perf_counter() - started,
        }

    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert self.llm is not None, "start first"
        params = SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids), ignore_eos=True
        )  # greedy; stops only at kvbench's stop ids, as kvbench's own decode
        engine = self.llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        self.next_id += 1
        request_id = str(self.next_id)
        reset_peak_rss()
        start = time.perf_counter()
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params)
        out, first, blocks = None, 0.0, 0
        per_group: list[int] = []
        null_id = scheduler.kv_cache_manager.block_pool.null_block.block_id
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id.split("-")[0] == request_id:  # the engine may suffix the id
                    out = output
            if out is not None and out.outputs[0].token_ids and not first:
                first = time.perf_counter()
            if not (out is not None and out.finished):  # the engine's own block table while the request runs
                # the scheduler knows the request by its internal id; it runs alone, so every id is this one's
                held = sum(held_blocks(scheduler.kv_cache_manager, rid) for rid in list(scheduler.requests))
                blocks = max(blocks, held)
                for rid in list(scheduler.requests):  # per group, without null blocks: a state holds one or a few
                    now = group_blocks(scheduler.kv_cache_manager, rid, null_id)
                    per_group = [max(a, b) for a, b in zip(per_group, now)] if per_group else now
        end = time.perf_counter()
        assert out is not None and out.finished
        tokens = list(out.outputs[0].token_ids)
        prefill_s = first - start
        return {
            "token_ids": tokens,
            "prefill_s": prefill_s,
            "decode_s": max(end - start - prefill_s, 0.0),
            "decode_steps": max(len(tokens) - 1, 0),
            "prefix_cached_tokens": int(out.num_cached_tokens or 0),
            "blocks_seen": blocks,  # the most blocks its block table held before the last step
            "group_blocks_seen": per_group,  # the same per KV cache group, null blocks left out
            "peak_mem_bytes": peak_rss_bytes(),
        }


@worker_op("serve_trace")
def serve_trace(
    worker: VllmWorker, requests: list[dict], stop_ids: list[int], sequential: bool = False, fresh: bool = True
) -> dict:
    """A request trace through vLLM's own continuous batching within the KV space `start` fixed
    (kvbench.engines.trace_driver: arrivals on the trace's clock, every step's tokens stamped). After each step the
    scheduler tells which requests it runs, its block pool's usage, each request's blocks and preemptions (vLLM
    preempts by recompute when the pool is full) and the prompt tokens its prefix cache supplied."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvbench.engines.trace_driver import drive

    assert worker.llm is not None, "start first"
    if fresh:  # no prefix cached by an earlier trace (`fresh=False`: keep them)
        worker.llm.reset_prefix_cache()
    engine = worker.llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager
    total_blocks = manager.block_pool.num_gpu_blocks - 1  # the null block is never handed out
    seen: dict[int, int] = {}
    cached: dict[int, int] = {}
    run = f"t{worker.next_id}"  # ids unique across calls: a finished request's id may not come back
    worker.next_id += 1

    def own(request_id: str) -> int:
        return int(request_id.split("-")[0].removeprefix(run + "r")) if request_id.startswith(run + "r") else -1

    def add(r: dict) -> None:
        params = SamplingParams(
            temperature=0.0, max_tokens=int(r["max_new_tokens"]), stop_token_ids=list(stop_ids), ignore_eos=True
        )  # greedy, stopping only at kvbench's stop ids, as kvbench's own decode
        engine.add_request(f"{run}r{r['id']}", TokensPrompt(prompt_token_ids=list(r["prompt_ids"])), params)
        seen[int(r["id"])] = 0

    def step() -> list:
        events = []
        for out in engine.step():
            rid = own(out.request_id)
            if rid < 0:
                continue
            tokens = list(out.outputs[0].token_ids)  # cumulative
            events.append((rid, tokens[seen[rid] :], "FINISHED" if out.finished else ""))
            seen[rid] = len(tokens)
            cached[rid] = max(cached.get(rid, 0), int(out.num_cached_tokens or 0))
        return events

    def sample() -> dict:
        requests_now = {own(rid): r for rid, r in scheduler.requests.items() if own(rid) >= 0}
        return {
            "running": [own(r.request_id) for r in scheduler.running],
            "kv_blocks": round(manager.usage * total_blocks),
            "concurrency": len(scheduler.running),
            "preemptions": {rid: r.num_preemptions for rid, r in requests_now.items()},
            "blocks": {rid: held_blocks(manager, r.request_id) for rid, r in requests_now.items()},
            "cached": dict(cached),
        }

    reset_peak_rss()
    out = drive(requests, add, step, engine.has_unfinished_requests, sample, sequential)
    config = manager.kv_cache_config
    # the bytes of one block of the pool the samples and block tables count: a hybrid model's KV cache groups (Gemma
    # 3: 6, sliding and global layers) alias one buffer from byte 0, each listed as its own tensor of its full size
    # (vllm/v1/core/kv_cache_utils.py), and every group takes its blocks from that one pool
    pool_block = sum(tensor.size for tensor in config.kv_cache_tensors) // len(config.kv_cache_groups)
    return {
        **out,
        "num_blocks": config.num_blocks,
        "block_size": worker.llm.llm_engine.vllm_config.cache_config.block_size,
        "block_bytes": pool_block // config.num_blocks,
        "peak_mem_bytes": peak_rss_bytes(),
    }


def main() -> None:
    serve_worker(VllmWorker())


if __name__ == "__main__":
    main()
