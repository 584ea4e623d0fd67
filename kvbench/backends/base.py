"""Serving engines behind one small interface: token ids in -> generated ids, timings and the cache bytes the engine
holds out. Each engine runs in its own venv (`.venv-<engine>`, built by `make engine-<engine>`) and its own process:
kvbench's process starts `<venv>/bin/python -m kvbench.backends.<name>_worker` and talks JSON lines over its
stdin/stdout (one request object per line in, one reply per line out). A worker imports only the standard library,
its engine and `kvbench.backends.protocol` (kvbench is installed `--no-deps` in the engine's venv), never torch from
kvbench's venv.

An engine's KV options are kvbench methods for that engine, named for what they are (`fp8_e5m2`, `q8_0`, `u4`,
`sum` ...): `Backend.options` maps each name to the engine's own knobs; `full` is always the engine's uncompressed
cache. Where an engine lets kvbench apply its own selection (llama.cpp's seq_rm), `Backend.applies` names the kvbench
methods it can run inside the engine and at which granularity.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass
class EngineRequest:
    prompt_ids: list[int]  # the whole prompt (context + question, query-aware), the tokenizer's ids
    max_new_tokens: int
    option: str  # a name of Backend.options (or of Backend.applies)
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


class Backend(abc.ABC):
    name: str  # engine=<name>
    venv: str  # ".venv-<name>"
    make_target: str  # "engine-<name>"
    options: dict[str, dict]  # kvbench method name -> the engine's knobs ({} for "full")
    applies: dict[str, str] = {}  # kvbench method name -> granularity note ("token positions, all layers and heads")

    info: dict = {}  # what the worker's start reported (`engine_version`, the model's shape)

    @classmethod
    def evicts(cls, option: str) -> bool:
        """Whether `option` evicts tokens (it takes kvbench's budget): kvbench's methods applied inside the engine,
        unless a backend says otherwise for its own eviction options."""
        return option in cls.applies

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
