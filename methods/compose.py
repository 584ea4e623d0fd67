"""Composition: structure (fewer KV heads) × sequence (token eviction) × precision (quantization), stacked.

`stack` names at most one method per family — e.g. [snapkv, kivi] or [headmerge, h2o, kivi] — applied in that
order whatever the order given: head merging converts the model, eviction selects the prompt's tokens (and keeps
evicting while decoding, through the quantized layers' `select`), quantization stores what is kept. Each part
starts from its conf/method/<name>.yaml; `overrides` sets parameters per part, e.g. {kivi: {bits: 2}}. The measured
kv_ratio should be close to the product of the parts' ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench import KvbenchError
from kvbench.methods.base import METHODS, Method, build_method, method_defaults
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import kv_layer

FAMILY_ORDER = ("structure", "eviction", "precision")


@METHODS.register("compose")
@dataclass
class Compose(Method):
    stack: list[str] = field(default_factory=lambda: ["snapkv", "kivi"])
    overrides: dict | None = None  # per-part parameters: {kivi: {bits: 2}}; None: each part's defaults

    family = "composite"

    def __post_init__(self):
        self.overrides = dict(self.overrides or {})  # overrides: null in the yaml (an empty {} would be struct-locked)
        unknown = sorted(set(self.overrides) - set(self.stack))
        if unknown:
            raise KvbenchError(f"compose overrides for {', '.join(unknown)}, not in stack={list(self.stack)}")
        parts: dict[str, Method] = {}
        for name in self.stack:
            if name in ("full", "compose"):
                raise KvbenchError(
                    f"compose stack: {name!r} cannot be stacked; use methods of the families {', '.join(FAMILY_ORDER)}"
                )
            part = build_method(name, {**method_defaults(name), **dict(self.overrides.get(name) or {})})
            if part.family in parts:
                raise KvbenchError(
                    f"compose stack: {parts[part.family].name} and {name} are both {part.family} "
                    f"methods; stack at most one per family ({', '.join(FAMILY_ORDER)})"
                )
            parts[part.family] = part
        if not parts:
            raise KvbenchError("compose needs a non-empty stack, e.g. method.stack=[snapkv,kivi]")
        self._parts = [parts[f] for f in FAMILY_ORDER if f in parts]
        self._eviction = parts.get("eviction")
        self._precision = parts.get("precision")
        self._structure = parts.get("structure")
        if self._precision and getattr(self._eviction, "positions", "absolute") == "rolling":
            raise KvbenchError(
                "compose: streamingllm positions=rolling re-rotates cached keys in place, which a "
                "quantized cache cannot do; use positions=absolute"
            )
        if getattr(self._eviction, "ring", False):
            raise KvbenchError(
                "compose: streamingllm ring=true decodes StreamingLLM's own plain K/V layers; "
                "use streamingllm ring=true without compose, or ring=false in the stack"
            )
        if (
            self._precision
            and not self._precision.layers_can_select
            and self._eviction
            and self._eviction.evicts_while_decoding()
        ):
            raise KvbenchError(
                f"compose: {self._eviction.name} evicts while decoding, which {self._precision.name}'s "
                "cache layers cannot do; use kivi, or an eviction method that compresses once "
                "(snapkv, pyramidkv, random, streamingllm evict_during_decode=false)"
            )
        # what the stack takes and does, from its parts (instance attributes shadow Method's class defaults)
        self.has_budget = self._eviction is not None
        self.shares_prefill = self._structure is None
        if self._precision and self._eviction:  # a later chunk would re-select from dequantized K/V
            self.chunk_limit = "eviction cannot re-select tokens of its quantized layers"

    @classmethod
    def lossless_params(cls, lm) -> dict:
        return {"stack": ["snapkv", "kivi"], "overrides": {"kivi": {"bits": 16}}}  # budget 1.0 and no quantization

    def params(self) -> dict:
        return {"stack": [p.name for p in self._parts], "parts": {p.name: p.params() for p in self._parts}}

    def bind(self, lm) -> None:
        for part in self._parts:
            part.bind(lm)

    def prepare_model(self, model):
        return self._structure.prepare_model(model) if self._structure else model

    def stats_request(self) -> StatsRequest:
        return self._eviction.stats_request() if self._eviction else StatsRequest()

    def begin_compress(self, n_prompt, n_layers, budget):
        if self._eviction:
            self._eviction.begin_compress(n_prompt, n_layers, budget)
        if self._precision:
            self._precision.begin_compress(n_prompt, n_layers, None)

    def compress_layer(self, layer_idx, keys, values, stats):
        """Eviction selects the layer's tokens, then precision stores what it kept."""
        layer = self._eviction.compress_layer(layer_idx, keys, values, stats) if self._eviction else None
        if self._precision:
            kept = (keys, values) if layer is None else (layer.keys, layer.values)
            layer = self._precision.compress_layer(layer_idx, *kept, stats)  # quantize what eviction kept
        return layer if layer is not None else kv_layer(keys, values)

    def end_compress(self, layers, stats, budget):
        cache = self._eviction.end_compress(layers, stats, budget) if self._eviction else None
        if self._precision:
            cache = self._precision.end_compress(cache.layers if cache is not None else layers, stats, None)
        return cache if cache is not None else super().end_compress(layers, stats, budget)

    def decode_request(self) -> StatsRequest:
        return self._eviction.decode_request() if self._eviction else StatsRequest()

    def evicts_while_decoding(self) -> bool:
        return bool(self._eviction and self._eviction.evicts_while_decoding())

    def on_extend(self, n_tokens: int) -> None:
        if self._eviction:
            self._eviction.on_extend(n_tokens)

    def on_decode_step(self, cache, stats) -> None:
        if self._eviction:
            self._eviction.on_decode_step(cache, stats)

    def position(self, absolute_position: int, cache) -> int:
        return self._eviction.position(absolute_position, cache) if self._eviction else absolute_position

    def begin_stream(self, n_tokens, n_layers, budget, first):
        raise KvbenchError("compose is not supported by the streaming perplexity task (task=ppl); run its parts")
