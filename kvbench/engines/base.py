"""Serving engines behind one small interface: token ids in -> generated ids, timings and the cache bytes the engine
holds out. Each engine runs in its own venv (`.venv-<engine>`, built by `make engine-<engine>`) and its own process:
kvbench's process starts `<venv>/bin/python -m kvbench.engines.<name>_worker` and talks JSON lines over its
stdin/stdout (one request object per line in, one reply per line out). A worker imports only the standard library,
its engine and `kvbench.engines.protocol` (kvbench is installed `--no-deps` in the engine's venv), never torch from
kvbench's venv.

An engine's KV options are kvbench methods for that engine, named for what they are (`fp8_e5m2`, `q8_0`, `u4`,
`sum` ...): `ServingEngine.options` maps each name to the engine's own knobs; `full` is always the engine's
uncompressed cache. Where an engine lets kvbench apply its own selection (llama.cpp's seq_rm), `ServingEngine.applies`
names the kvbench methods it can run inside the engine and at which granularity.

An engine's ServingEngine is the only door to it: kvbench's run (kvbench.run), serving trace (kvbench.serving), report
(kvbench.report) and config loop over the registry (`kvbench.engines.ENGINES`) and ask the class what they need —
its options and refusals, its venv and make target, how it serves a trace (`serve`) and compares prefix caching
(`serve_prefix`), its block size, and how the report names it. No module outside kvbench/engines names an engine
(tests/test_engine_names.py).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

from kvbench import KvbenchError


@dataclass
class EngineRequest:
    prompt_ids: list[int]  # the whole prompt (context + question, query-aware), the tokenizer's ids
    max_new_tokens: int
    option: str  # a name of ServingEngine.options (or of ServingEngine.applies)
    knobs: dict = field(default_factory=dict)  # the option's engine knobs, with the run's overrides
    budget: float | None = None  # eviction options: kvbench's budget (fraction of the prompt, or tokens > 1)
    stop_ids: list[int] = field(default_factory=list)  # end-of-turn ids: generation stops after one
    reuse_prefix: bool = False  # the engine may keep the previous request's tokens this prompt starts with (llama.cpp)


@dataclass
class EngineGeneration:
    token_ids: list[int]  # generated ids, greedy, the stop id included when one ended it
    prefill_s: float  # time to first token, as the engine's own process measured it
    decode_s: float  # the decode steps after the first token
    decode_steps: int
    kv_bytes: int  # the cache the engine physically holds for this sequence at the end (its own tensors/blocks)
    kv_bytes_full: int  # the same engine's uncompressed cache for the same tokens (kv_ratio = kv_bytes / this)
    peak_mem_bytes: int  # the worker process's peak RSS during the request
    engine_version: str
    extra: dict = field(default_factory=dict)  # engine-specific measured values (blocks used, evicted tokens, ...)
    invalid: str = ""  # why this generation is not a valid result (an option known to compute garbage): kept out of
    # every average (report, guide, gate), shown apart with this reason; "" for a valid one


class ServingEngine(abc.ABC):
    name: str  # engine=<name>
    venv: str  # ".venv-<name>"
    make_target: str  # "engine-<name>"
    options: dict[str, dict]  # kvbench method name -> the engine's knobs ({} for "full")
    applies: dict[str, str] = {}  # kvbench method name -> granularity note ("token positions, all layers and heads")
    order: int = 100  # where lists of engines (messages, docs' tables) name it: by order, then by name

    # how the report names it (kvbench.report.sections.engines)
    label: str = ""  # its name in prose ("" : its engine name)
    marker: str = "P"  # its marker on the plot of every engine (kvbench's own is "o")
    baseline: str = "the model's dtype"  # what its `full` cache holds: the denominator of its kv_ratio

    # serving a request trace (kvbench.serving.engines, `serve`): the options it serves one with, () for none
    serving_options: tuple[str, ...] = ()
    block_tokens: int = 1  # its KV block in tokens: a request takes whole blocks
    tells_queue: bool = False  # its trace replies say when each request was scheduled, its preemptions and blocks

    # prefix caching side by side (kvbench.serving.prefix, `serve_prefix`)
    prefix_cache: bool = False  # it has a prefix cache to compare
    tells_hits: bool = True  # its replies count the prompt tokens its prefix cache supplied

    info: dict = {}  # what the worker's start reported (`engine_version`, the model's shape)

    @classmethod
    def evicts(cls, option: str) -> bool:
        """Whether `option` evicts tokens (it takes kvbench's budget): kvbench's methods applied inside the engine,
        unless an engine says otherwise for its own eviction options."""
        return option in cls.applies

    @classmethod
    def installed(cls) -> bool:
        """Whether its venv is built (`make <make_target>`)."""
        from kvbench.engines import source  # looked up at call time: tests stand in a machine without venvs

        return source.venv_python(cls.venv).exists()

    @classmethod
    def element_bytes(cls, option: str) -> int | None:
        """Bytes per K/V element of `option`'s cache, for the check that a KV budget holds one request before the
        engine starts; None: the model's dtype (also an upper bound for a precision only the engine knows)."""
        return None

    @classmethod
    def serving_need(cls, option: str, token_bytes: int, elements_per_token: int, tokens: int) -> int:
        """Bytes of the engine's KV space one request of `tokens` tokens needs: whole blocks at the option's
        precision (`token_bytes`: the model dtype's bytes per token; `elements_per_token`: its K/V elements)."""
        per_element = cls.element_bytes(option)
        token = token_bytes if per_element is None else elements_per_token * per_element
        return math.ceil(tokens / cls.block_tokens) * cls.block_tokens * token

    @property
    def version(self) -> str:
        return str(self.info.get("engine_version", ""))

    @abc.abstractmethod
    def unavailable(self, model_cfg: dict, option: str) -> str | None:
        """Why this engine cannot run `option` on this model here, in one line naming the fix (the make target, or
        the alternative option); None when it can. Called before any model loads."""

    @abc.abstractmethod
    def start(self, model_cfg: dict, dtype: str) -> None:
        """Start the worker for this model (paths resolved/converted here, in kvbench's process)."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> EngineGeneration: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def serving_start(self, model_cfg: dict, dtype: str) -> None:
        """Before the first `serve` of a serving run (closed by `close`): start the worker by default."""
        self.start(model_cfg, dtype)

    def serving_refusal(self, option: str, budget: float | None, requests: list[dict]) -> str:
        """Why `option` would compute wrong tokens on this trace ("" when it would not): that option is not served,
        in one line. `requests` as `serve` takes them."""
        return ""

    def serve(
        self, option: str, budget: float | None, kv_budget: int, requests: list[dict], stop_ids: list[int]
    ) -> tuple[dict, int]:
        """Serve a request trace ({"id", "arrival_s", "prompt_ids", "max_new_tokens"} each) with the engine's own
        continuous batching in `kv_budget` bytes of KV space: (the worker's serve_trace reply —
        kvbench.engines.trace_driver's record, plus `engine_version` —, the bytes of one of its KV blocks)."""
        raise KvbenchError(f"engine={self.name} serves no request trace")

    def serve_prefix(
        self, model_cfg: dict, dtype: str, traces: dict[str, list[dict]], stop_ids: list[int], kv_space: int
    ) -> dict[str, tuple[dict, dict]]:
        """Each workload's requests (as `serve` takes them) in order, each after the one before finished, without
        then with the engine's prefix cache: {workload: (reply without, reply with)}, each reply's `requests` with
        `tokens`, `arrival_s`, `first_token_s` and `cached_tokens`. `kv_space`: bytes, where the engine takes them."""
        raise KvbenchError(f"engine={self.name} has no prefix cache to compare")
