"""The run modes, in one table: when each is active, what it does not combine with and why, and what it adds to the
config hash and to the rows. Nothing else decides which modes combine: `refusal(facts)` reads MODES, NEEDS and
CONFLICTS; `hash_keys(spec)` collects what the active modes add to a configuration's hash; the runner reads
`batched(facts)` and `row_keys(spec)`.

A mode is a setting (`prefill=inline`, `batch_size=4`), a kind of task (a streamed text, requests in order, an
external harness scoring its own requests), a kind of method (kvpress's hooks; one needing every layer first), or
a kind of model (sliding-window layers, known once its config is read). `RunFacts` holds what decides them; before
the model's config is known `sliding` is None and the model's rows of the table wait for the second check.
docs/cli.md's "Run modes" table is this table (tests/preflight/test_modes.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvbench import KvbenchError
from kvbench.config.spec import RunSpec
from kvbench.engines import listed
from kvbench.methods import Method
from kvbench.methods.modes import HooksPrefill
from kvbench.native.inline import compresses_per_layer
from kvbench.tasks.base import Task


@dataclass(frozen=True)
class RunFacts:
    """What decides a run's modes: its settings, its task's class, its configurations' methods, the model's layers."""

    spec: RunSpec
    task: type[Task]  # the task's class: its `kind` and name
    methods: tuple = ()  # the built methods of the run's configurations
    sliding: bool | None = None  # the model has sliding-window layers; None: its config is not read yet
    hybrid: bool | None = None  # the model has linear-attention / Mamba / conv layers (a state per request)

    def first(self, test: Callable) -> str:
        """The name of the first method passing `test` ("" if none)."""
        return next((m.name for m in self.methods if test(m)), "")


@dataclass(frozen=True)
class Mode:
    key: str  # how the tables refer to it
    label: Callable[[RunFacts], str]  # how a message names it ("batch_size=4", "task=ppl (a streamed text)")
    active: Callable[[RunFacts], bool]
    hash_keys: Callable[[RunSpec], dict] = lambda spec: {}  # what its rows add to config_hash when active
    columns: tuple[str, ...] = ()  # row columns it adds (docs/results.md)


def _hooked(method) -> bool:
    return isinstance(method, HooksPrefill)


def _whole_prefill(method) -> bool:
    return isinstance(method, Method) and not compresses_per_layer(method)


def _chunk_limited(method) -> bool:
    return bool(method.caps.chunk_limit)


def _task(words: str) -> Callable[[RunFacts], str]:
    return lambda f: f"task={f.task.name} ({words})"


def _prefill_hash(spec: RunSpec) -> dict:
    # an inline or chunked prefill is measured apart from a shared one (its peak memory, a chunked prefill's kept
    # entries differ)
    return {"prefill": spec.prefill, **({"prefill_chunk": spec.prefill_chunk} if spec.prefill_chunk else {})}


def _prefix_hash(spec: RunSpec) -> dict:
    return {
        "prefix_cache": True,
        "reuse": spec.reuse,
        "page_size": spec.page_size,
        "prefix_cache_bytes": spec.prefix_cache_bytes,
    }


MODES = {
    m.key: m
    for m in (
        Mode("inline", lambda f: "prefill=inline", lambda f: f.spec.prefill == "inline", _prefill_hash),
        Mode("chunked", lambda f: f"prefill_chunk={f.spec.prefill_chunk}", lambda f: f.spec.prefill_chunk is not None),
        Mode(
            "prefix_cache",
            lambda f: "prefix_cache=true",
            lambda f: f.spec.prefix_cache,
            _prefix_hash,
            ("request_index", "prefill_tokens", "reused_tokens", "hit_rate", "store_bytes", "held_bytes"),
        ),
        Mode("compress_once", lambda f: "reuse=compress_once", lambda f: f.spec.reuse == "compress_once"),
        Mode(
            "batch",
            lambda f: f"batch_size={f.spec.batch_size}",
            lambda f: f.spec.batch_size > 1,
            lambda spec: {"batch_size": spec.batch_size},  # its own timings
            ("batch_size", "decode_tokens_per_s"),
        ),
        Mode(
            "diagnose",
            lambda f: "diagnose=true",
            lambda f: f.spec.diagnose,
            columns=("verdict", "mass_recall", "kl_mean", "first_divergence_step", "evidence_retention"),
        ),
        Mode("stream", _task("a streamed text"), lambda f: f.task.kind == "stream", columns=("window",)),
        Mode("workload", _task("requests in order"), lambda f: f.task.kind == "workload", columns=("request_index",)),
        Mode("external", _task("lm-eval scores its own requests"), lambda f: f.task.kind == "external"),
        Mode(
            "hooked",
            lambda f: f"method={f.first(_hooked)} (kvpress's hooks)",
            lambda f: any(map(_hooked, f.methods)),
            columns=("kv_ratio_nominal",),
        ),
        Mode(
            "whole_prefill_method",
            lambda f: f"method={f.first(_whole_prefill)} (it needs every layer first)",
            lambda f: any(map(_whole_prefill, f.methods)),
        ),
        Mode(
            "chunk_limited_method",
            lambda f: (
                f"method={f.first(lambda m: m.caps.chunk_limit)} "
                f"({next(m.caps.chunk_limit for m in f.methods if m.caps.chunk_limit)})"
            ),
            lambda f: any(m.caps.chunk_limit for m in f.methods),
        ),
        Mode("sliding", lambda f: "a model with sliding-window layers", lambda f: bool(f.sliding)),
        Mode("hybrid", lambda f: "a hybrid model (linear-attention or Mamba layers)", lambda f: bool(f.hybrid)),
        Mode("context_only", lambda f: "query_aware=false", lambda f: not f.spec.query_aware),
        Mode(
            "no_fidelity",
            lambda f: "fidelity=false",
            lambda f: not f.spec.fidelity,
            lambda spec: {"fidelity": False},  # its rows lack the KL columns: never served to a run that wants them
        ),
        Mode(
            "engine",
            lambda f: f"engine={f.spec.engine_name}",
            lambda f: f.spec.engine_name != "kvbench",
            lambda spec: {"engine": spec.engine_name},  # + the engine's version, once it has started (config_hash)
            ("engine", "engine_version", "engine_extra", "engine_invalid"),
        ),
    )
}

# mode → the mode it needs, and the fix
NEEDS = {
    "chunked": (
        "inline",
        "compresses each chunk as it lands (a shared prefill keeps the whole prompt); add prefill=inline or drop "
        "prefill_chunk",
    ),
    "compress_once": ("prefix_cache", "keeps the compressed context in the prefix cache; add prefix_cache=true"),
}

_OWN_PREFILL = "it needs the prompt's uncompressed K/V or a prefill of its own; use prefill=shared for this run"
_HOOKS = (
    "kvpress's hooks compress inside its own prefill, decoded by the engine's own loop; run it with prefill=shared, "
    "batch_size=1, no prefix cache or diagnose, on a generation task"
)
_WINDOWS = (
    "sliding-window layers are not yet kept at their window there; run it with prefill=shared, batch_size=1 and a "
    "generation task"
)
_STATES = (
    "its linear-attention/Mamba states are carried through one shared prefill and one decode per configuration "
    "only; run it with prefill=shared, batch_size=1, no prefix cache or diagnose, on a generation task"
)
_ENGINE = (
    "a serving engine runs each whole prompt greedily in its own process, one request at a time; use engine=kvbench "
    "for it"
)
ENGINE_ALONE = "inline chunked prefix_cache batch diagnose stream workload external hooked context_only".split()
# (mode, other, why and fix): both active → refused, in this order (the first that applies is the message)
CONFLICTS: list[tuple[str, str, str]] = [
    ("hooked", "inline", _HOOKS),
    ("hooked", "diagnose", _HOOKS),
    ("hooked", "prefix_cache", _HOOKS),
    ("hooked", "workload", _HOOKS),
    ("hooked", "batch", _HOOKS),
    ("hooked", "external", _HOOKS),
    ("hooked", "stream", _HOOKS),
    ("diagnose", "stream", "it streams a text, so there is no decoded answer to teacher-force; use diagnose=false"),
    ("diagnose", "external", "lm-eval scores its requests itself: no decoded answer; use diagnose=false"),
    ("batch", "stream", "it streams one text through the cache; use batch_size=1"),
    ("batch", "workload", "its requests run in order, each reusing the ones before; use batch_size=1"),
    ("batch", "external", "lm-eval's requests run one at a time; use batch_size=1"),
    ("batch", "diagnose", "each example is teacher-forced on its own; use batch_size=1"),
    ("batch", "prefix_cache", "requests run in order, each reusing the ones before; use batch_size=1"),
    ("chunked", "stream", "it streams its text in task.chunk tokens; drop prefill_chunk and set task.chunk"),
    ("inline", "diagnose", _OWN_PREFILL),
    ("inline", "prefix_cache", _OWN_PREFILL),
    ("inline", "workload", _OWN_PREFILL),
    ("inline", "batch", _OWN_PREFILL),
    ("inline", "external", _OWN_PREFILL),
    ("inline", "whole_prefill_method", "it cannot compress inside the forward pass; use prefill=shared for it"),
    (
        "chunked",
        "chunk_limited_method",
        "it cannot re-compress its cache after each chunk; drop prefill_chunk for it (prefill=inline alone works)",
    ),
    *(("engine", other, _ENGINE) for other in ENGINE_ALONE),
    ("inline", "sliding", _WINDOWS),
    *(("hybrid", o, _STATES) for o in "inline chunked batch prefix_cache workload stream external diagnose".split()),
    ("batch", "sliding", _WINDOWS),
    ("stream", "sliding", _WINDOWS),
]


WHEN = {  # when each mode is active, in words (the table's second column)
    "inline": "`prefill=inline`",
    "chunked": "`prefill_chunk=N`",
    "prefix_cache": "`prefix_cache=true`",
    "compress_once": "`reuse=compress_once`",
    "batch": "`batch_size` > 1",
    "diagnose": "`diagnose=true`",
    "stream": "a task of kind `stream` (`ppl`)",
    "workload": "a task of kind `workload` (`shared_doc`, `multiturn`, ...)",
    "external": "a task of kind `external` (`lm_eval`)",
    "hooked": "`method=kvpress`",
    "whole_prefill_method": "a method selecting across layers (`kvzip`)",
    "chunk_limited_method": "a method that cannot re-compress per chunk (`adakv`, `compose`, ...)",
    "sliding": "a model with sliding-window layers (Gemma 2/3, Mistral, gpt-oss)",
    "hybrid": "a hybrid model (Qwen3.5, Qwen3-Next, Nemotron-H, Granite 4.0-H, Jamba, Bamba, LFM2, OLMo-hybrid)",
    "context_only": "`query_aware=false`",
    "no_fidelity": "`fidelity=false` (no KL columns, kvbench.native.fidelity)",
    "engine": "`engine=" + "`, `".join(listed()) + "` (kvbench.engines)",  # every registered serving engine
}


def markdown() -> str:
    """The run-mode table of docs/cli.md, from MODES, NEEDS and CONFLICTS (tests/preflight/test_modes.py holds them
    equal)."""
    lines = [
        "| mode | active with | needs | does not combine with | config hash adds | rows add |",
        "|---|---|---|---|---|---|",
    ]
    example = RunSpec(prefill="inline", prefill_chunk=256, prefix_cache=True, reuse="compress_once", batch_size=4)
    for key, mode in MODES.items():
        needs = NEEDS.get(key, ("", ""))[0]
        others = [b if a == key else a for a, b, _ in CONFLICTS if key in (a, b)]
        hashed = ", ".join(f"`{k}`" for k in mode.hash_keys(example))
        lines.append(
            f"| {key} | {WHEN[key]} | {needs or '–'} | {', '.join(dict.fromkeys(others)) or '–'} | {hashed or '–'} "
            f"| {', '.join(f'`{c}`' for c in mode.columns) or '–'} |"
        )
    return "\n".join(lines)


def active(facts: RunFacts) -> list[str]:
    return [key for key, mode in MODES.items() if mode.active(facts)]


def refusal(facts: RunFacts) -> str | None:
    """Why these modes cannot run together, in one line naming the fix; None when they can."""
    on = set(active(facts))
    for mode, (needed, why) in NEEDS.items():
        if mode in on and needed not in on:
            return f"{MODES[mode].label(facts)} needs {MODES[needed].label(facts)}: it {why}"
    for mode, other, why in CONFLICTS:
        if mode in on and other in on:
            return f"{MODES[mode].label(facts)} does not combine with {MODES[other].label(facts)}: {why}"
    return None


def check(facts: RunFacts) -> None:
    reason = refusal(facts)
    if reason:
        raise KvbenchError(reason)


def hash_keys(spec: RunSpec, task: type[Task]) -> dict:
    """What the active settings add to a configuration's hash (rows of another mode never answer for these)."""
    facts = RunFacts(spec, task)
    out: dict = {}
    for key in active(facts):
        out.update(MODES[key].hash_keys(spec))
    return out


def row_keys(spec: RunSpec) -> dict:
    """The columns every row of a run records about its prefill (whichever mode)."""
    return {"prefill": spec.prefill, "prefill_chunk": spec.prefill_chunk}


def batched(facts: RunFacts) -> bool:
    """Examples of equal length decoded together (kvbench.run.batched_work): batch_size > 1 on a generation task
    (every other combination is refused by CONFLICTS)."""
    return "batch" in active(facts)


def requests_in_order(facts: RunFacts) -> bool:
    """Requests run in order through kvbench.run.requests: a workload task, or any task with the prefix cache."""
    return bool({"workload", "prefix_cache"} & set(active(facts)))
