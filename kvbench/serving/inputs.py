"""The `serving:` block, checked before the model loads (`check`), and the built trace against the loaded model
(`check_requests`): each bad value is one KvbenchError line naming the fix. Torch-free until a model shape is read.

Checked: unknown keys; requests an integer ≥ 1; arrival burst | poisson; rate a number > 0; prompts task | random;
prompt_tokens [min, max] integers 1 ≤ min ≤ max; output_tokens null | n | [min, max]; shared_prefix in [0, 1);
kv_budget_bytes bytes (an integer ≥ 1), a multiple of one request's full cache ("2x", ≥ 1x) or a list of them;
slo_ttft_s, slo_tpot_s > 0 and in order (a token's time cannot be bounded above the first token's, whose prefill
includes a forward: slo_tpot_s ≤ slo_ttft_s); the longest request (prompt + output) within the model's context;
every budget holding the longest request alone for every configuration (its prefill's whole prompt, then its
compressed cache growing to its last token). A multiple is resolved once the model's shape and dtype are known
(`ServingSpec.resolved`): bytes double in fp32, the number of requests a budget holds does not.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field, replace

from kvbench import KvbenchError
from kvbench.serving.engines import check_engine_budgets, check_engines

DEFAULTS = {
    "requests": 8,
    "arrival": "burst",
    "rate": 1.0,
    "prompts": "task",
    "prompt_tokens": [256, 512],
    "output_tokens": None,
    "shared_prefix": 0.0,
    "kv_budget_bytes": None,
    "slo_ttft_s": 10.0,
    "slo_tpot_s": 1.0,
    "hardware": "cpu",
    "engines": {},
    "out": None,
}


@dataclass(frozen=True)
class ServingSpec:
    requests: int
    arrival: str
    rate: float
    prompts: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int] | None
    shared_prefix: float
    kv_budget_forms: tuple[int | float, ...]  # bytes (int), or multiples of one request's full cache (float: "2x")
    slo_ttft_s: float
    slo_tpot_s: float
    hardware: str
    out: str | None
    engines: dict = field(default_factory=dict)  # engine -> options serving the same trace (kvbench.serving.engines)
    request_bytes: int | None = None  # one longest request's full cache, once the model's shape is known (resolved)

    @property
    def kv_budgets(self) -> tuple[int, ...]:
        """The budgets in bytes; multiples need `resolved` first (they depend on the model's shape and dtype)."""
        if self.request_bytes is None and any(isinstance(b, float) for b in self.kv_budget_forms):
            raise RuntimeError("kv_budget_bytes has multiples: call ServingSpec.resolved(cfg, shape) first")
        return tuple(
            b if isinstance(b, int) else math.ceil(b * (self.request_bytes or 0)) for b in self.kv_budget_forms
        )

    def resolved(self, cfg, shape) -> ServingSpec:
        """With `request_bytes` for `shape` (kvbench.model.kv_bytes.KVShape): what the longest request the config
        asks for needs alone with the full cache (request_need), so "1x" holds one at a time in any dtype."""
        from kvbench.methods import build_method

        prompt, output = longest(cfg, self)
        spec = replace(self, request_bytes=request_need(shape, build_method("full"), None, prompt, output))
        if spec.kv_budget_forms != spec.kv_budgets:
            print(
                f"[serving] kv_budget_bytes {', '.join(_form(b) for b in self.kv_budget_forms)} = "
                f"{', '.join(f'{b:,}' for b in spec.kv_budgets)} bytes (one {prompt:,} + {output}-token request's full "
                f"cache: {spec.request_bytes:,} bytes in {str(shape.dtype).removeprefix('torch.')})",
                file=sys.stderr,
            )
        return spec

    def trace_spec(self, seed: int):
        from kvbench.serving.trace import TraceSpec

        return TraceSpec(
            self.requests,
            self.arrival,
            self.rate,
            self.prompts,
            self.prompt_tokens,
            self.output_tokens,
            self.shared_prefix,
            seed,
        )


MULTIPLE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)x")  # "2x", "1.5x": times one request's full cache


def _form(b: int | float) -> str:
    return f"{b:g}x" if isinstance(b, float) else str(b)


def _budget_forms(value) -> tuple[int | float, ...]:
    """kv_budget_bytes as given: bytes (int ≥ 1) or multiples (float ≥ 1 from "2x"), one or a list."""
    values = value if isinstance(value, (list, tuple)) else [value]
    forms: list[int | float] = []
    for v in values:
        match = MULTIPLE.fullmatch(v.strip()) if isinstance(v, str) else None
        if _is_int(v) and v >= 1:
            forms.append(v)
        elif match and float(match.group(1)) >= 1:
            forms.append(float(match.group(1)))
        else:
            forms = []
            break
    if not forms:
        raise KvbenchError(
            f"serving.kv_budget_bytes={value!r} must be bytes (an integer ≥ 1), a multiple ≥ 1x of one request's "
            "full cache (2x) or a list of them; use serving.kv_budget_bytes=[1.6x,10x] or [20000000,80000000]"
        )
    return tuple(forms)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _pair(key: str, value, example: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_int(v) for v in value)):
        raise KvbenchError(f"serving.{key}={value!r} is not [min, max] integers; use serving.{key}={example}")
    lo, hi = value
    if not 1 <= lo <= hi:
        raise KvbenchError(f"serving.{key}={list(value)}: need 1 ≤ min ≤ max; use serving.{key}={example}")
    return lo, hi


def serving_spec(block) -> ServingSpec:
    """The block's values checked one by one (no model needed)."""
    from kvbench.config.rules import plain

    given = dict(plain(block) or {})
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise KvbenchError(f"serving.{unknown[0]} is not a serving setting; the settings: {', '.join(DEFAULTS)}")
    v = {**DEFAULTS, **given}
    if not _is_int(v["requests"]) or not 1 <= v["requests"] <= 100_000:
        raise KvbenchError(
            f"serving.requests={v['requests']!r} must be an integer in [1, 100000]; use serving.requests=8"
        )
    if v["arrival"] not in ("burst", "poisson"):
        raise KvbenchError(f"serving.arrival={v['arrival']!r}: use serving.arrival=burst (all at t=0) or poisson")
    if not _is_number(v["rate"]) or v["rate"] <= 0:
        raise KvbenchError(f"serving.rate={v['rate']!r} must be a number > 0 (requests per second); use serving.rate=2")
    if v["prompts"] not in ("task", "random"):
        raise KvbenchError(
            f"serving.prompts={v['prompts']!r}: use serving.prompts=task (the task's examples) or random"
        )
    prompt_tokens = _pair("prompt_tokens", v["prompt_tokens"], "[256,512]")
    out = v["output_tokens"]
    if out is None:
        output = None
    elif _is_int(out):
        if out < 1:
            raise KvbenchError(f"serving.output_tokens={out} must be ≥ 1; use serving.output_tokens=16")
        output = (out, out)
    else:
        output = _pair("output_tokens", out, "[8,24]")
    share = v["shared_prefix"]
    if not _is_number(share) or not 0 <= share < 1:
        raise KvbenchError(f"serving.shared_prefix={share!r} must be in [0, 1); use serving.shared_prefix=0.5")
    budgets = _budget_forms(v["kv_budget_bytes"])
    for key in ("slo_ttft_s", "slo_tpot_s"):
        if not _is_number(v[key]) or v[key] <= 0:
            raise KvbenchError(f"serving.{key}={v[key]!r} must be a number of seconds > 0; use serving.{key}=1.0")
    if v["slo_tpot_s"] > v["slo_ttft_s"]:
        raise KvbenchError(
            f"serving.slo_tpot_s={v['slo_tpot_s']} > serving.slo_ttft_s={v['slo_ttft_s']}: the SLOs are in the wrong "
            "order (the first token includes a prefill, so its bound is the larger); swap them"
        )
    return ServingSpec(
        v["requests"],
        v["arrival"],
        float(v["rate"]),
        v["prompts"],
        prompt_tokens,
        output,
        float(share),
        budgets,
        float(v["slo_ttft_s"]),
        float(v["slo_tpot_s"]),
        str(v["hardware"]),
        v["out"],
        check_engines(v["engines"]),
    )


def longest(cfg, spec: ServingSpec) -> tuple[int, int]:
    """(prompt, output) tokens of the longest request the config asks for, before any prompt is built."""
    from kvbench.config.rules import plain
    from kvbench.tasks import TASKS

    if spec.prompts == "random":
        return spec.prompt_tokens[1], spec.output_tokens[1] if spec.output_tokens else 16
    want = TASKS.get(cfg.task.name).longest_request(plain(cfg.task))
    if want is None:
        raise KvbenchError(
            f"task={cfg.task.name} declares no prompt length; serve it with serving.prompts=random or a task with "
            "context_lengths (niah, ruler)"
        )
    return want.prompt, spec.output_tokens[1] if spec.output_tokens else want.new


def request_need(shape, method, budget, prompt: int, output: int) -> int:
    """Bytes one request needs alone (`shape`: kvbench.model.kv_bytes.KVShape with its layout): its prompt's whole
    K/V while prefilling (+ one token), and its compressed cache + every token it generates (the last step's new
    token included) as the planner's accounting predicts it (kvbench.model.kv_bytes)."""
    from kvbench.model.kv_bytes import predict_kv_bytes

    layout = shape.layout
    decoded = predict_kv_bytes(method, budget, shape, prompt, decoded_tokens=output).kv_bytes
    return max(layout.dense_bytes(prompt), decoded) + layout.full_bytes(1)  # the prefill: every layer, whole prompt


def check_fit(shape, max_context: int, confs, budgets, prompt: int, output: int, what: str) -> None:
    if shape.layout is not None and shape.layout.is_hybrid:
        raise KvbenchError(
            "serving a hybrid model (linear-attention or Mamba layers) is not supported: the scheduler decodes its "
            "requests' K/V as one batch, and each request's recurrent state would have to travel with it; measure it "
            "with python -m kvbench (one request at a time) and size it with python -m kvbench.plan"
        )
    if max_context and prompt + output > max_context:
        raise KvbenchError(
            f"{what}: {prompt:,} prompt + {output} output tokens is more than the model's context of {max_context:,}; "
            "use shorter prompts or outputs"
        )
    for c in confs:
        need = request_need(shape, c.method, c.budget, prompt, output)
        for b in budgets:
            if b < need:
                raise KvbenchError(
                    f"serving.kv_budget_bytes={b:,} holds not one request: {what} ({prompt:,} prompt + {output} output "
                    f"tokens) needs {need:,} bytes with {c.method.name}; use serving.kv_budget_bytes ≥ {need:,}"
                )


def check(cfg) -> tuple[ServingSpec, list]:
    """Everything before the model loads: the run's own keys (kvbench.preflight.entrance), the
    `serving:` block, and — where the model's shape is known without loading it — context and budgets. Returns the
    spec and the run's configurations (the full cache first)."""
    from omegaconf import OmegaConf

    from kvbench.config.spec import RunSpec
    from kvbench.model import layout as layers
    from kvbench.model.kv_bytes import KVShape
    from kvbench.model.load import model_config, resolve_device, resolve_dtype
    from kvbench.preflight.entrance import check_config
    from kvbench.rows.configuration import configurations

    spec = serving_spec(cfg.get("serving"))
    rest = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "serving"])
    check_config(rest)
    run = RunSpec.of(rest)
    if run.engine_name != "kvbench":  # the run's engine key answers examples one at a time, not a trace
        raise KvbenchError(
            f"engine={run.engine_name} with a serving trace: engines serve it through serving.engines; use "
            f"engine=kvbench 'serving.engines=[{run.engine_name}:full]'"
        )
    if run.prefix_cache:
        raise KvbenchError(
            "prefix_cache=true with a serving trace: the scheduler has no prefix cache; compare prefix caching with "
            "python -m kvbench.serving.prefix"
        )
    confs = configurations(run)
    config = model_config(cfg.model, cheap=True)
    if config is not None:  # the bundled GGUF before its first conversion: checked once loaded (check_requests)
        dtype = resolve_dtype(cfg.dtype, resolve_device(cfg.device))
        shape = KVShape(
            layers.n_layers(config),
            layers.n_kv_heads(config),
            layers.head_dim(config),
            dtype,
            layers.cache_layout(config, dtype),
        )
        spec = spec.resolved(cfg, shape)
        prompt, output = longest(cfg, spec)
        check_fit(shape, config.max_position_embeddings, confs, spec.kv_budgets, prompt, output, "the longest request")
        check_engine_budgets(spec.engines, shape, spec.kv_budgets, prompt, output)
    return spec, confs


def check_requests(requests, lm, confs, budgets, engines=None) -> None:
    """The built trace against the loaded model: exact prompt lengths (tokenized) and output lengths."""
    from kvbench.model.kv_bytes import KVShape

    r = max(requests, key=lambda q: q.prompt_tokens + q.max_new_tokens)
    shape = KVShape.of(lm)
    check_fit(shape, lm.max_context, confs, budgets, r.prompt_tokens, r.max_new_tokens, f"request {r.request_id}")
    check_engine_budgets(engines or {}, shape, budgets, r.prompt_tokens, r.max_new_tokens)
