"""Composition: structure (fewer KV heads) × sequence (token eviction) × precision (quantization), stacked.

`stack` names at most one method per family — e.g. [snapkv, kivi] or [headmerge, h2o, kivi] — applied in that
order whatever the order given: head merging converts the model, eviction selects the prompt's tokens (and keeps
evicting while decoding, through the quantized layers' `select`), quantization stores what is kept. Each part
starts from its conf/method/<name>.yaml; `overrides` sets parameters per part, e.g. {kivi: {bits: 2}}. The measured
kv_ratio should be close to the product of the parts' ratios.

The parts are `structure`, `eviction` and `precision` (None where the stack has none): the planner's byte
accounting (kvbench.model.kv_bytes) reads them, and the stack's capabilities are derived from theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvbench import KvbenchError
from kvbench.methods.base import METHODS, Capabilities, Method, build_method, method_defaults
from kvbench.methods.compression import Compression
from kvbench.methods.modes import ChangesModel
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import kv_layer

FAMILY_ORDER = ("structure", "eviction", "precision")


@METHODS.register("compose")
@dataclass
class Compose(ChangesModel, Method):
    stack: list[str] = field(default_factory=lambda: ["snapkv", "kivi"])
    overrides: dict | None = None  # per-part parameters: {kivi: {bits: 2}}; None: each part's defaults

    caps = Capabilities(family="composite", stream_limit="run its parts")

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
            given = dict(self.overrides.get(name) or {})
            part = build_method(name, {**method_defaults(name), **given}, where=f"compose.overrides.{name}")
            family = part.caps.family
            if family in parts:
                raise KvbenchError(
                    f"compose stack: {parts[family].name} and {name} are both {family} "
                    f"methods; stack at most one per family ({', '.join(FAMILY_ORDER)})"
                )
            parts[family] = part
        if not parts:
            raise KvbenchError("compose needs a non-empty stack, e.g. method.stack=[snapkv,kivi]")
        self.parts = [parts[f] for f in FAMILY_ORDER if f in parts]
        self.structure, self.eviction, self.precision = (parts.get(f) for f in FAMILY_ORDER)
        self._check_stack()
        # what the stack takes and does, from its parts
        self.caps = replace(
            self.caps,
            has_budget=self.eviction is not None,
            shares_prefill=self.structure is None,
            compresses_inline=all(p.caps.compresses_inline for p in self.parts),
            evicts_while_decoding=bool(self.eviction and self.eviction.caps.evicts_while_decoding),
            # a later chunk would re-select from dequantized K/V
            chunk_limit=(
                "eviction cannot re-select tokens of its quantized layers"
                if self.precision and self.eviction
                else next((p.caps.chunk_limit for p in self.parts if p.caps.chunk_limit), "")
            ),
        )

    def _check_stack(self) -> None:
        """Parts that cannot work together: one line naming the fix."""
        eviction, precision = self.eviction, self.precision
        if eviction is None:
            return
        if precision and eviction.caps.reindexes_positions:
            raise KvbenchError(
                "compose: streamingllm positions=rolling re-rotates cached keys in place, which a "
                "quantized cache cannot do; use positions=absolute"
            )
        if eviction.caps.decodes_alone:  # StreamingLLM ring=true
            raise KvbenchError(
                "compose: streamingllm ring=true decodes StreamingLLM's own plain K/V layers; "
                "use streamingllm ring=true without compose, or ring=false in the stack"
            )
        if precision and not precision.caps.layers_can_select and eviction.caps.evicts_while_decoding:
            raise KvbenchError(
                f"compose: {eviction.name} evicts while decoding, which {precision.name}'s "
                "cache layers cannot do; use kivi, or an eviction method that compresses once "
                "(snapkv, pyramidkv, random, streamingllm evict_during_decode=false)"
            )

    @classmethod
    def lossless_params(cls, lm) -> dict:
        return {"stack": ["snapkv", "kivi"], "overrides": {"kivi": {"bits": 16}}}  # budget 1.0 and no quantization

    def params(self) -> dict:
        return {"stack": [p.name for p in self.parts], "parts": {p.name: p.params() for p in self.parts}}

    def bind(self, lm) -> None:
        for part in self.parts:
            part.bind(lm)

    def prepare_model(self, model):
        return self.structure.prepare_model(model) if isinstance(self.structure, ChangesModel) else model

    def stats_request(self) -> StatsRequest:
        return self.eviction.stats_request() if self.eviction else StatsRequest()

    # ---- the compress path: eviction selects, precision stores what it kept -----------------------------------
    def begin(self, n_prompt, n_layers, budget) -> Stacked:
        return Stacked(self, n_prompt, n_layers, budget)


class Stacked(Compression):
    """One example's stack: the eviction part's compression selects, the precision part's stores what it kept;
    decoding is the eviction part's."""

    method: Compose

    def __init__(self, method: Compose, n_prompt: int, n_layers: int, budget):
        super().__init__(method, n_prompt, n_layers, budget)
        eviction, precision = method.eviction, method.precision
        self.eviction = eviction.begin(n_prompt, n_layers, budget) if eviction else None
        self.precision = precision.begin(n_prompt, n_layers, None) if precision else None
        if self.eviction:
            self.kept = self.eviction.kept  # what eviction keeps
        # decoding: the eviction part's hooks (none without one)
        self.decoding = self.eviction or Compression(method, n_prompt, n_layers, None)
        self.acts_while_decoding = self.decoding.acts_while_decoding

    def layer(self, layer_idx, keys, values, stats):
        """Eviction selects the layer's tokens, then precision stores what it kept."""
        layer = self.eviction.layer(layer_idx, keys, values, stats) if self.eviction else None
        if self.precision:
            kept = (keys, values) if layer is None else (layer.keys, layer.values)
            layer = self.precision.layer(layer_idx, *kept, stats)  # quantize what eviction kept
        return layer if layer is not None else kv_layer(keys, values)

    def end(self, layers, stats):
        cache = self.eviction.end(layers, stats) if self.eviction else None
        if self.precision:
            cache = self.precision.end(cache.layers if cache is not None else layers, stats)
        return cache if cache is not None else super().end(layers, stats)

    # ---- decoding: the eviction part's ------------------------------------------------------------------------
    def decode_request(self) -> StatsRequest:
        return self.decoding.decode_request()

    def on_extend(self, n_tokens: int) -> None:
        self.decoding.on_extend(n_tokens)

    def on_decode_start(self, cache, position: int) -> None:
        self.decoding.on_decode_start(cache, position)

    def on_decode_step(self, cache, stats) -> None:
        self.decoding.on_decode_step(cache, stats)

    def position(self, absolute_position: int, cache) -> int:
        return self.decoding.position(absolute_position, cache)

    def slack(self) -> int:
        return self.decoding.slack()
