"""engine=openvino: OpenVINO GenAI's ContinuousBatchingPipeline (CPU) behind kvbench's ServingEngine interface.

The model: kvbench's converted HF folder exported once to OpenVINO IR by optimum-intel in .venv-ov-convert
(~40 s) into $KVBENCH_CACHE/<model>/openvino-<version>/. That venv holds transformers 5.0.0: optimum-intel 2.2 exports
Gemma 3 only up to transformers 5.0 (Llama, SmolLM2's, with any version it installs with), and 5.0.0 reads kvbench's
converted folders, so one converter serves both bundled models. Exact runs: INFERENCE_PRECISION_HINT follows
kvbench's dtype (f32 for dtype=float32, bf16 for bfloat16); the `full` cache is KV_CACHE_PRECISION at that same
precision (OpenVINO's CPU default would be u8).

Options: `u8`, `u4` (KV_CACHE_PRECISION), and eviction inside continuous batching: `sum`, `norm_sum`, `kvcrush`
(SUM + KVCrush), `adaptive_rkv`. Eviction works on 32-token blocks per layer (scores summed over heads), keeps
`start_size` tokens at the front and `recent_size` at the end inside `max_cache_size`, evicts nothing during the
prefill (the peak holds the whole prompt) and first evicts after a decode step. kvbench's budget b (tokens of the
prompt) maps to max_cache_size = b + max_new_tokens rounded up to a block: kvbench's methods compress the prompt to b
and append the generated tokens, so at budget ≥ prompt nothing is evicted and the run is the engine's full run.

Sliding-window layers (Gemma 3: 15 of 18, window 512): OpenVINO holds every token in every layer (the IR's window
is a mask inside attention), and its eviction has no notion of layer types: it evicts the sliding layers' blocks too,
down to the same max_cache_size, and the sliding layers then behave as if their window counted the cache slots
left, not token positions. Once
max_cache_size - start_size < window, the never-evicted start tokens (the attention sink, far beyond the window by
position) fall inside the sliding layers' window again and the needle is lost (measured on a 700-token prompt:
start_size 32 is exact at max_cache_size 544 and wrong at 512; start_size 64 is wrong at 544 and exact at 608; a
prompt shorter than the window evicts exactly; docs/engine.md). Such generations run and are flagged invalid
(`sliding_window_break`), as vLLM's garbage kv_cache_dtypes are: the threshold depends on the prompt's length, known
only per example.

kv_bytes = the blocks the sequence holds at its last step (PipelineMetrics.cache_usage × num_kv_blocks) × the
block's bytes at the real precision: the engine's own block size (kv_cache_size_in_bytes / num_kv_blocks, which
includes u8/u4 scales and zero points), except that the engine counts u4 data at one byte per element: kvbench
counts it at half a byte. kv_bytes_full = the blocks the same tokens take uncompressed × the full-precision block.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kvbench import KvbenchError, cache_root
from kvbench.engines import ENGINES
from kvbench.engines.base import EngineGeneration, EngineRequest, ServingEngine
from kvbench.engines.protocol import Worker
from kvbench.engines.source import CacheShape, budget_tokens, hf_model_dir, venv_python

BLOCK = 32  # OpenVINO's CPU KV block, in tokens
VERSION = "2026.4.1"
PRECISION = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
BYTES = {"f32": 4.0, "bf16": 2.0, "f16": 2.0, "u8": 1.0, "u4": 0.5}
EVICTION = {"sum": "SUM", "norm_sum": "NORM_SUM", "kvcrush": "SUM", "adaptive_rkv": "ADAPTIVE_RKV"}
CONVERTER_TRANSFORMERS = "5.0.0"  # optimum-intel 2.2's bound for Gemma 3's export (make engine-openvino pins it)


def installed_version(venv: str, package: str) -> str | None:
    """A package's version in an engine venv, from its dist-info folder (no interpreter started)."""
    found = sorted(venv_python(venv).parent.parent.glob(f"lib/python*/site-packages/{package}-*.dist-info"))
    return found[-1].name.removesuffix(".dist-info").split("-")[-1] if found else None


@ENGINES.register("openvino")
class OpenvinoEngine(ServingEngine):
    name = "openvino"
    venv = ".venv-openvino"
    make_target = "engine-openvino"
    converter_venv = ".venv-ov-convert"
    order = 3
    label, marker = "OpenVINO", "D"
    serving_options = ("full", "u8", "u4", "sum", "norm_sum")
    block_tokens = BLOCK
    prefix_cache = True  # enable_prefix_caching
    tells_hits = False  # the pipeline does not say how many prompt tokens its prefix cache supplied
    options = {
        "full": {},
        "u8": {"kv_cache_precision": "u8"},
        "u4": {"kv_cache_precision": "u4"},
        **{name: {"cache_eviction": {"aggregation_mode": mode}} for name, mode in EVICTION.items()},
    }
    options["kvcrush"]["cache_eviction"]["kvcrush_budget"] = 2  # blocks KVCrush picks out of the evictable area

    @classmethod
    def evicts(cls, option: str) -> bool:
        """Its own eviction options (SUM, NORM_SUM, KVCrush, ADAPTIVE_RKV) take kvbench's budget."""
        return "cache_eviction" in cls.options.get(option, {})

    def __init__(self, kv_blocks: int = 512, start_size: int = BLOCK, recent_size: int = 2 * BLOCK):
        self.kv_blocks = kv_blocks  # the fixed KV space: 512 blocks = 16,384 tokens
        self.start_size, self.recent_size = start_size, recent_size
        self.worker: Worker | None = None
        self.shape: CacheShape | None = None
        self.precision = "f32"
        self.info: dict = {}
        self.serving_blocks: dict[str, int] = {}  # option -> bytes per block (u8/u4: one probe pipeline each)

    def unavailable(self, model_cfg: dict, option: str) -> str | None:
        if option not in self.options:
            return f"engine=openvino has no option {option!r}; use one of {', '.join(self.options)}"
        if option == "adaptive_rkv":  # measured on SmolLM2: it runs while nothing is evicted, fails once it evicts
            return (
                f"engine=openvino adaptive_rkv fails on CPU in OpenVINO GenAI {VERSION} as soon as it evicts "
                "(Check '!m_last_block_diversity.empty()' failed); use sum, norm_sum or kvcrush"
            )
        for venv in (self.venv, self.converter_venv):
            if not venv_python(venv).exists():
                return f"engine=openvino needs {venv}: run `make {self.make_target}`"
        converter = installed_version(self.converter_venv, "transformers")
        if not (self.ir_dir(model_cfg) / "openvino_model.xml").is_file() and converter != CONVERTER_TRANSFORMERS:
            return (
                f"engine=openvino exports the model with transformers {CONVERTER_TRANSFORMERS} in "
                f"{self.converter_venv} (optimum-intel 2.2 exports Gemma 3 only up to 5.0), which has {converter}: "
                f"run `make {self.make_target}`"
            )
        return None

    @staticmethod
    def ir_dir(model_cfg: dict) -> Path:
        """The IR's folder: by kvbench's model name, and for model=hub by its checkpoint too (every hub checkpoint is
        named `hub`: one folder for all would hand one model's IR to another)."""
        name = str(model_cfg.get("name", "model"))
        source = model_cfg.get("name_or_path")
        if source:
            name += "-" + hashlib.sha256(str(source).encode()).hexdigest()[:12]
        return cache_root() / name / f"openvino-{VERSION}"

    def start(self, model_cfg: dict, dtype: str) -> None:
        if dtype not in PRECISION:
            raise KvbenchError(f"engine=openvino runs dtype=float32, bfloat16 or float16, not {dtype}")
        self.precision = PRECISION[dtype]
        ir = self.converted(model_cfg)
        self.shape = CacheShape.read(ir)
        threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        self.worker = Worker(venv_python(self.venv), "kvbench.engines.openvino_worker", "the openvino worker")
        reply = self.worker.request(
            "start", model_dir=str(ir), inference_precision=self.precision, kv_blocks=self.kv_blocks, threads=threads
        )
        self.info = reply

    def converted(self, model_cfg: dict) -> Path:
        """The model as OpenVINO IR, exported once from kvbench's HF folder by optimum-intel (its own venv)."""
        target = self.ir_dir(model_cfg)
        sweep_exports(target)
        if target.exists():
            problem = ir_problem(target)
            if problem:
                raise KvbenchError(
                    f"the OpenVINO IR cached in {target} is damaged ({problem}); delete that folder "
                    f"(rm -r {target}) and rerun: it is exported again"
                )
            return target
        source = hf_model_dir(model_cfg)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{target.name}.tmp{os.getpid()}-"))
        cli = venv_python(self.converter_venv).parent / "optimum-cli"
        print(f"[kvbench] exporting {source} to OpenVINO IR once into {target} (about 40 s)", flush=True)
        command = [str(cli), "export", "openvino", "--model", str(source), "--task", "text-generation-with-past"]
        done = subprocess.run([*command, "--weight-format", "fp32", str(tmp)], capture_output=True, text=True)
        problem = ir_problem(tmp)  # an export that exits 0 may still leave an empty model
        if done.returncode != 0 or problem:
            shutil.rmtree(tmp, ignore_errors=True)
            last = (done.stderr.strip().splitlines() or [problem or "no output"])[-1]
            raise KvbenchError(
                f"optimum-intel could not export {source} to OpenVINO IR ({last}); see `{' '.join(command)}`"
            )
        os.replace(tmp, target)
        return target

    def knobs(self, request: EngineRequest) -> dict:
        """The option's engine knobs with the eviction sizes filled in from kvbench's budget."""
        knobs = {**self.options[request.option], **request.knobs}
        if "cache_eviction" in knobs:
            kept = budget_tokens(request.budget, len(request.prompt_ids)) + request.max_new_tokens
            floor = self.start_size + self.recent_size + BLOCK  # the engine needs an evictable area
            size = max(floor, math.ceil(kept / BLOCK) * BLOCK)
            sizes = {"start_size": self.start_size, "recent_size": self.recent_size, "max_cache_size": size}
            knobs["cache_eviction"] = {**sizes, **knobs["cache_eviction"]}
        return knobs

    def sliding_window_break(self, request: EngineRequest, knobs: dict) -> str:
        """Why an eviction on a model with sliding-window layers computes garbage here ("" when it does not): the
        engine windows the slots left after eviction, so below window + start_size the start tokens re-enter the
        window (module docstring)."""
        eviction = knobs.get("cache_eviction")
        if not eviction or self.shape is None or not self.shape.sliding_layers:
            return ""
        window, start, size = self.shape.window, int(eviction["start_size"]), int(eviction["max_cache_size"])
        tokens = len(request.prompt_ids) + request.max_new_tokens
        if size - start >= window or tokens <= window or size >= tokens:
            return ""  # the start tokens stay outside the window, no token ever leaves it, or nothing is evicted
        # the smallest budget (tokens) whose max_cache_size, rounded up to a block, reaches window + start_size
        smallest = (math.ceil((window + start) / BLOCK) - 1) * BLOCK + 1 - request.max_new_tokens
        return (
            f"OpenVINO GenAI {VERSION} evicts the {self.shape.sliding_layers} sliding-window layers too and windows "
            f"the slots left: max_cache_size {size} - start_size {start} < window {window}, so the start tokens "
            f"re-enter the window (wrong tokens, measured); valid from budget >= {smallest} tokens"
        )

    def generate(self, request: EngineRequest) -> EngineGeneration:
        if self.worker is None or self.shape is None:
            raise KvbenchError("OpenvinoEngine.generate before start()")
        knobs = self.knobs(request)
        reply = self.worker.request(
            "generate",
            prompt_ids=list(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
            stop_ids=list(request.stop_ids),
            knobs=knobs,
        )
        kv_precision = knobs.get("kv_cache_precision", self.precision)
        elements = BLOCK * self.shape.elements_per_token()  # K and V elements of one block, all layers
        engine_block = reply["engine_block_bytes"]
        # the engine's block bytes count u4 data at 1 byte per element: half a byte is what it holds
        block = engine_block - elements // 2 if kv_precision == "u4" else engine_block
        full_block = int(elements * BYTES[self.precision])
        held_tokens = len(request.prompt_ids) + reply["decode_steps"]  # the last generated token is never written
        blocks_full = math.ceil(held_tokens / BLOCK)
        return EngineGeneration(
            token_ids=reply["token_ids"],
            prefill_s=reply["prefill_s"],
            decode_s=reply["decode_s"],
            decode_steps=reply["decode_steps"],
            kv_bytes=reply["blocks_held"] * block,
            kv_bytes_full=blocks_full * full_block,
            peak_mem_bytes=reply["peak_mem_bytes"],
            engine_version=self.version,
            invalid=self.sliding_window_break(request, knobs),
            extra={
                "knobs": knobs,
                "blocks_held": reply["blocks_held"],
                "blocks_peak": reply["blocks_peak"],
                "blocks_full": blocks_full,
                "block_bytes": block,
                "engine_block_bytes": engine_block,  # the engine's own figure (u4: 2x the data it holds)
                "engine_kv_bytes": reply["blocks_held"] * engine_block,
                "peak_kv_bytes": reply["blocks_peak"] * block,  # nothing is evicted during the prefill
                "inference_precision": self.precision,
                "kv_cache_precision": kv_precision,
            },
        )

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def block_bytes(self, option: str) -> int:
        """Bytes of one 32-token block at the option's KV precision: the model dtype's, or for u8/u4 the engine's
        own block (scales and zero points included; u4 data counted at half a byte, as `generate` counts it)."""
        if self.shape is None or self.worker is None:
            raise KvbenchError("OpenvinoEngine.block_bytes before start()")
        elements = BLOCK * self.shape.elements_per_token()  # K and V elements of one block, all layers
        precision = self.options[option].get("kv_cache_precision")
        if precision is None:
            return int(elements * BYTES[self.precision])
        if option not in self.serving_blocks:
            engine_block = int(self.worker.request("block_bytes", knobs=self.options[option])["engine_block_bytes"])
            if engine_block <= elements // 2:
                raise KvbenchError(f"OpenVINO reported {engine_block} bytes per KV block for {option}: not a block")
            self.serving_blocks[option] = engine_block - (elements // 2 if precision == "u4" else 0)
        return self.serving_blocks[option]

    def trace_knobs(self, option: str, budget: float | None, requests: list[dict]) -> tuple[EngineRequest, dict]:
        """The trace's longest request as a probe, and the option's knobs for it (an eviction's max_cache_size from
        the budget and that request)."""
        longest = max(requests, key=lambda r: len(r["prompt_ids"]))
        probe = EngineRequest([0] * len(longest["prompt_ids"]), longest["max_new_tokens"], option, budget=budget)
        return probe, self.knobs(probe)

    def serving_refusal(self, option: str, budget: float | None, requests: list[dict]) -> str:
        """An eviction option that would break a model's sliding-window layers (`sliding_window_break`), checked on
        the longest request."""
        return self.sliding_window_break(*self.trace_knobs(option, budget, requests))

    def serve(
        self, option: str, budget: float | None, kv_budget: int, requests: list[dict], stop_ids: list[int]
    ) -> tuple[dict, int]:
        """The ContinuousBatchingPipeline (the model's IR compiled anew per trace: each its own block count and
        knobs) in `num_kv_blocks` = budget // the option's bytes per block (`block_bytes`). It does not say which
        requests it scheduled, nor their preemptions and blocks (`tells_queue` False)."""
        knobs = self.trace_knobs(option, budget, requests)[1]
        block = self.block_bytes(option)
        assert self.worker is not None
        reply = self.worker.request(
            "serve_trace", requests=requests, stop_ids=list(stop_ids), knobs=knobs, kv_blocks=int(kv_budget) // block
        )
        reply["engine_version"] = self.version
        reply["knobs"] = knobs
        return reply, block

    def serve_prefix(
        self, model_cfg: dict, dtype: str, traces: dict[str, list[dict]], stop_ids: list[int], kv_space: int
    ) -> dict[str, tuple[dict, dict]]:
        """One worker, its pipeline built per trace in its own fixed KV space (`kv_blocks`, not `kv_space`), with
        and without `enable_prefix_caching`; its eviction and its prefix cache do not combine."""
        self.start(model_cfg, dtype)
        assert self.worker is not None
        out = {}
        for workload, requests in traces.items():
            without, with_cache = (
                self.worker.request(
                    "serve_trace",
                    requests=requests,
                    stop_ids=stop_ids,
                    knobs={},
                    kv_blocks=self.kv_blocks,
                    prefix_caching=cached,
                    sequential=True,
                )
                for cached in (False, True)
            )
            out[workload] = (without, with_cache)
        return out


def ir_problem(folder: Path) -> str:
    """Why an IR folder cannot be used ("" when it can): its xml must parse and its weights be there, not empty."""
    from xml.etree import ElementTree

    xml, weights = folder / "openvino_model.xml", folder / "openvino_model.bin"
    try:
        ElementTree.parse(xml)
    except (OSError, ElementTree.ParseError) as error:
        return f"{xml.name} does not parse: {error}"
    if not weights.is_file() or weights.stat().st_size == 0:
        return f"{weights.name} is missing or empty"
    return ""


def sweep_exports(target: Path) -> None:
    """Remove the temporary folders of exports whose process no longer runs (`<target>.tmp<pid>-...`, left by a
    killed export); a folder without a pid (an older kvbench's) once it is an hour old."""
    for folder in target.parent.glob(f"{target.name}.tmp*"):
        pid = folder.name.removeprefix(f"{target.name}.tmp").split("-")[0]
        if not pid.isdigit():
            stale = time.time() - folder.stat().st_mtime > 3600
        else:
            stale = int(pid) != os.getpid() and not running(int(pid))
        if stale:
            shutil.rmtree(folder, ignore_errors=True)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
