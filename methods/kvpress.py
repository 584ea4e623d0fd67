"""Any kvpress press (NVIDIA/kvpress, the optional extra `kvpress`) as a kvbench method, measured as kvbench measures.

`method=kvpress method.press=SnapKVPress budget=0.25 'method.press_kwargs={window_size: 64}'` runs the press the
kvpress way — its own forward hooks on the attention modules of kvbench's loaded model, compressing kvbench's real
DynamicCache in place during the prompt's forward (`with press(model):`) — and then decodes with kvbench's loop, so
the row's `kv_bytes` is what the cache physically holds. `budget` is kvpress's `compression_ratio = 1 − budget` (a
token count: 1 − count / prompt tokens); `kv_ratio_nominal` is what the press claims, on kv_ratio's footing.

Presses by class name (`method.press=KnormPress`), or as a mapping whose `name` is the class and whose other keys
are its fields; a field holding a press takes a class name or another such mapping:
    'method.press={name: AdaKVPress, press: SnapKVPress, alpha_safeguard: 0.2}'
    'method.press={name: AdaKVPress, press: {name: ExpectedAttentionPress, n_sink: 4}}'
`method.press_kwargs` are more fields of the outermost press (merged into the mapping). Names, fields and the values
kvpress's own `__post_init__` asserts are checked when the configuration is built, before the model loads.

Head-wise presses (AdaKV, KVzip, CriticalAdaKV, DuoAttention, DMS, ...) evict nothing: they record
`module.masked_key_indices` and kvpress's attention patch (kvpress/attention_patch.py, re-applied here to kvbench's
attention function) overwrites those keys with a fake key while decoding — "not optimal as it does not reduce peak
memory", in kvpress's own words. Their measured kv_ratio is therefore the full cache's; `kept_masks` (per layer,
(B, H_kv, T) bool: the positions a head still attends to) records what they keep all the same, the fidelity tests'
view of any press (tests/kvpress/). kvbench's own AdaKV and KVzip store such choices ragged and physically.

Decode-time presses (DecodingPress, PrefillDecodingPress, DMSPress with decoding) keep their hooks on while the
suffix is appended and tokens are generated, as kvpress's pipeline does; prefill presses only around the prefill.
Presses that read attention weights (ObservedAttentionPress, kvpress's H2O-like press; kvbench's counterpart is
`h2o score=mean`) run their prompt's forward with transformers' eager attention, as kvpress requires: its
(B, H_q, T, T) weights per layer are part of their peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench import KvbenchError
from kvbench.methods.base import METHODS, Budget, Capabilities, Method
from kvbench.methods.modes import HooksPrefill
from kvbench.model.attention import ATTN_IMPLEMENTATION, kvbench_sdpa

EAGER_PRESSES = ("ObservedAttentionPress",)  # read the attention weights: their prefill runs eager attention
DECODE_PRESSES = ("DecodingPress", "PrefillDecodingPress")  # kvpress's pipeline hooks them while decoding
NO_KVPRESS = (
    "method=kvpress needs the kvpress extra: pip install -e '.[kvpress]' torch==2.13.0 in a venv of its own "
    "(kvpress 0.5.5 pins transformers < 5.3; `make test-kvpress` builds one at .venv-kvpress)"
)


def available() -> bool:
    return importlib.util.find_spec("kvpress") is not None


def press_classes() -> dict[str, type]:
    """kvpress's presses by class name (everything it exports that is a BasePress)."""
    import kvpress

    _patch_kvbench_attention()  # its import wrapped every registered attention function, kvbench's included
    return {
        name: cls
        for name in kvpress.__all__
        if isinstance(cls := getattr(kvpress, name), type) and issubclass(cls, kvpress.BasePress)
    }


def press_spec(press: Any, press_kwargs: dict | None = None) -> dict:
    """`method.press` (a class name or a {name: ..., field: ...} mapping) + press_kwargs as one mapping."""
    spec = {"name": press} if isinstance(press, str) else dict(press) if isinstance(press, dict) else {}
    if not isinstance(spec.get("name"), str):
        raise KvbenchError(
            f"method.press={press!r}: give a kvpress class name (method.press=SnapKVPress) or a mapping naming it, "
            "e.g. 'method.press={name: AdaKVPress, press: SnapKVPress}'"
        )
    return {**spec, **dict(press_kwargs or {})}


def build_press(spec: dict, where: str = "method.press"):
    """The press `spec` describes (nested presses built first); one KvbenchError line for an unknown press, an
    unknown or missing field, or a value kvpress's own checks refuse."""
    classes = press_classes()
    name, given = spec["name"], {k: v for k, v in spec.items() if k != "name"}
    if name not in classes:
        close = difflib.get_close_matches(name, classes, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise KvbenchError(f"{where}: kvpress has no press {name!r}; {hint}presses: {', '.join(sorted(classes))}")
    cls = classes[name]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise KvbenchError(
            f"{where}: {name} has no field {', '.join(map(repr, unknown))}; its fields: {', '.join(fields) or '(none)'}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in given.items():
        holds_press = "Press" in str(hints.get(key, ""))
        if isinstance(value, dict) or (holds_press and isinstance(value, str)):
            value = build_press(press_spec(value), f"{where}.{key}")
        kwargs[key] = value
    missing = [
        f.name
        for f in fields.values()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kwargs
    ]
    if missing:
        raise KvbenchError(
            f"{where}: {name} needs {', '.join(missing)} (a press), e.g. "
            f"'method.press={{name: {name}, {missing[0]}: SnapKVPress}}'"
        )
    try:
        return cls(**kwargs)
    except (AssertionError, TypeError, ValueError) as error:
        raise KvbenchError(
            f"{where}: kvpress refuses {name}({_show(given)}): {error or 'its own check failed'}"
        ) from None


def describe(press) -> str:
    """A built press with all its fields but the ratio kvbench sets, nested presses alike:
    AdaKVPress(press=SnapKVPress(window_size=64, kernel_size=5), alpha_safeguard=0.2)."""
    fields = []
    for f in dataclasses.fields(press):
        if not f.init or f.name == "compression_ratio":
            continue
        value = getattr(press, f.name)
        fields.append(f"{f.name}={describe(value) if dataclasses.is_dataclass(value) else repr(value)}")
    return f"{type(press).__name__}({', '.join(fields)})"


def _show(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def compression_ratio(budget: Budget | None, n_prompt: int) -> float:
    """kvpress's knob for kvbench's budget: 1 − the fraction; a token count n keeps n of the prompt's tokens under
    kvpress's rounding down (compute_n_kept: int(T · (1 − ratio)), so (n + ½) / T rather than n / T)."""
    if budget is None:
        return 0.0
    if not budget.is_tokens:
        return 1.0 - budget.value
    return max(0.0, 1.0 - (budget.tokens(n_prompt) + 0.5) / n_prompt)


def has_ratio(press) -> bool:
    """Whether the press takes a compression_ratio (a field, or AdaKV's property onto its scorer)."""
    return "compression_ratio" in {f.name for f in dataclasses.fields(press)} or isinstance(
        getattr(type(press), "compression_ratio", None), property
    )


@dataclass
class KVPress(HooksPrefill, Method):
    press: Any = "SnapKVPress"  # a kvpress class name, or {name: <class>, <field>: value, ...} (nested presses)
    press_kwargs: dict = field(default_factory=dict)  # more fields of the outermost press

    caps = Capabilities(
        compresses_inline=False,
        chunk_limit="kvpress compresses once, inside its own prefill",
        stream_limit="a kvbench method (kvpress's presses compress a prompt once)",
        shares_prefill=False,  # its hooks run inside a prefill of its own
        # its hooks and attention patch sit on model.model.layers[i].self_attn; a sliding layer's window would be
        # compressed as if it were the prompt (tests/model/test_architectures.py: logits differ at budget 1.0)
        needs=frozenset({"kvbench_attention", "llama_layout", "no_sliding_layers"}),
    )

    def __post_init__(self):
        self._spec = press_spec(self.press, self.press_kwargs)
        self._press = build_press(self._spec)
        # a press without compression_ratio (DecodingPress) keeps what its own fields say: no budget
        self.caps = dataclasses.replace(self.caps, has_budget=has_ratio(self._press))
        self.kept_masks: list[torch.Tensor | None] = []
        self._claim: tuple[int, int] | None = None  # (prompt tokens, tokens the press claims to keep of them)

    @property
    def press_name(self) -> str:
        return self._spec["name"]

    # ---- the prefill, hooked ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooked_prefill(self, lm, n_prompt: int, budget: Budget | None):
        """Around the prompt's forward: the press's hooks (prefill presses), a fingerprint of each layer's keys
        before the press touches them (kept_masks), and kvpress's attention patch on kvbench's attention."""
        press, model = self._press, lm.model
        _patch_kvbench_attention()
        if self.caps.has_budget:
            press.compression_ratio = compression_ratio(budget, n_prompt)
            from kvpress.utils import compute_n_kept

            kept = n_prompt if press.compression_ratio == 0 else compute_n_kept(n_prompt, press.compression_ratio)
            self._claim = (n_prompt, kept)
        else:
            self._claim = None
        fingerprints: dict = {}  # layer → (B, H_kv, T) fingerprints of its prompt keys; "cache" → the cache
        attention = [layer.self_attn for layer in _layers(model)]
        hooks = [a.register_forward_hook(_fingerprint_hook(fingerprints), with_kwargs=True) for a in attention]
        try:
            with (
                _tokenizer_for(lm),
                _eager_attention(model) if self.press_name in EAGER_PRESSES else contextlib.nullcontext(),
                contextlib.nullcontext() if self.press_name in DECODE_PRESSES else press(model),
            ):
                yield
        finally:
            for hook in hooks:
                hook.remove()
        cache = fingerprints.pop("cache", None)
        self.kept_masks = [
            None
            if i not in fingerprints
            else kept_mask_of(fingerprints[i], cache.layers[i].keys, getattr(a, "masked_key_indices", None))
            for i, a in enumerate(attention)
        ]

    @contextlib.contextmanager
    def hooked_decode(self, lm):
        """Around appending the suffix and decoding: decode-time presses' hooks; afterwards the head-wise masks
        are taken off the attention modules, so no other configuration decodes with them."""
        try:
            with self._press(lm.model) if self.press_name in DECODE_PRESSES else contextlib.nullcontext():
                yield
        finally:
            for layer in _layers(lm.model):
                layer.self_attn.masked_key_indices = None

    def kv_ratio_nominal(self, context_tokens: int, decoded: int) -> float | None:
        """The cache the press claims, as a share of the full one at the same tokens: its kept prompt tokens
        (kvpress's compute_n_kept) plus every token appended after the prompt; None for a press without a ratio."""
        if self._claim is None:
            return None
        n_prompt, kept = self._claim
        return (kept + context_tokens - n_prompt + decoded) / (context_tokens + decoded)

    def begin(self, n_prompt, n_layers, budget):
        raise KvbenchError(
            "method=kvpress compresses inside its own prefill (kvpress's hooks); this path gave it a prefill "
            "already made: run it with prefill=shared, batch_size=1, no prefix cache, diagnose or streamed task"
        )

    @classmethod
    def lossless_params(cls, lm) -> dict | None:
        return None  # every press at compression_ratio 0 is the full cache, but that is a budget, not a knob

    def params(self) -> dict:
        """The press as given, and as built with every field kvpress defaults (`resolved`, e.g. SnapKVPress's
        window_size=64 where kvbench's snapkv has 32: a default that can decide a verdict shows in the report)."""
        return {"press": self._spec, "resolved": describe(self._press)}


# registered only where kvpress imports: the main venv's every-method tests never meet it; `method=kvpress` there
# says how to install it (Registry.unavailable)
if available():
    METHODS.register("kvpress")(KVPress)
else:
    METHODS.unavailable("kvpress", NO_KVPRESS)
    KVPress.name = "kvpress"


def _layers(model):
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return inner.layers


def _patch_kvbench_attention() -> None:
    """kvbench's attention function with kvpress's patch (its head-wise masks act while decoding) — for attention
    modules that hold kvpress's masks only: kvpress's wrapper reads `key.shape`, which kvbench's own ragged and
    quantized layers (adakv, kivi) do not have, so every other configuration of the process keeps the plain
    function. kvpress wraps every registered function when it is imported and kvbench registers its own when a
    model loads: this runs after both (press_classes, hooked_prefill) and is idempotent."""
    from kvpress.attention_patch import attention_patch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if getattr(ALL_ATTENTION_FUNCTIONS.get(ATTN_IMPLEMENTATION), "_kvpress_routed", False):
        return
    patched = attention_patch(kvbench_sdpa)

    def routed(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
        if getattr(module, "masked_key_indices", None) is None:
            return kvbench_sdpa(module, query, key, value, attention_mask, dropout, **kwargs)
        return patched(module, query, key, value, attention_mask, dropout, **kwargs)

    routed._kvpress_routed = True  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION] = routed


@contextlib.contextmanager
def _eager_attention(model):
    """transformers' eager attention around the prompt's forward, for presses that read its weights (kvpress
    requires attn_implementation="eager" for them): (B, H_q, T, T) per layer, as kvpress itself holds them."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def _tokenizer_for(lm):
    """KVzipPress loads the tokenizer by `model.config.name_or_path` (a hub name); kvbench's models may be GGUF
    files or random ones: it gets the loaded tokenizer instead."""
    from kvpress.presses import kvzip_press

    original = kvzip_press.AutoTokenizer

    class Loaded:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return lm.tokenizer

    kvzip_press.AutoTokenizer = Loaded
    try:
        yield
    finally:
        kvzip_press.AutoTokenizer = original


def fingerprint(keys: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) keys → (B, H, T) int64: a hash of each key's first 8 elements' bytes. A gather copies a key's
    bytes, so a kept key has its position's fingerprint (kept_masks finds positions by it)."""
    raw = keys[..., :8].contiguous().view(torch.uint8).long()  # (B, H, T, 8·itemsize)
    weights = torch.tensor(1000003, dtype=torch.long).pow(torch.arange(raw.shape[-1]))  # wraps mod 2⁶⁴: still a hash
    return (raw * weights.to(raw.device)).sum(-1)  # (B, H, T)


def _fingerprint_hook(store: dict):
    def hook(module, args, kwargs, output):
        layer = module.layer_idx
        if layer not in store:  # the prompt's forward (KVzip's reconstruction forwards come after it)
            store["cache"] = kwargs["past_key_values"]
            store[layer] = fingerprint(store["cache"].layers[layer].keys)
        return output

    return hook


def kept_mask_of(before: torch.Tensor, held_keys: torch.Tensor, masked=None) -> torch.Tensor | None:
    """Positions kept: `before` (B, H, T) fingerprints of the prompt's keys, `held_keys` (B, H, N, D) what the
    layer holds after the press, `masked` kvpress's (batch, head, slot) indices of masked slots."""
    ordered, order = before.sort(dim=-1)  # (B, H, T)
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        return None
    held = fingerprint(held_keys)  # (B, H, N)
    slot = torch.searchsorted(ordered, held).clamp(max=before.shape[-1] - 1)  # (B, H, N)
    if not bool((ordered.gather(-1, slot) == held).all()):
        return None  # the layer holds keys the prompt did not produce (merged or re-rotated keys)
    positions = order.gather(-1, slot)  # (B, H, N) prompt position of each held slot
    kept = torch.zeros(before.shape, dtype=torch.bool, device=before.device)
    kept.scatter_(-1, positions, True)
    if masked is not None:
        batch, head, slots = masked
        kept[batch, head, positions[batch, head, slots]] = False
    return kept
