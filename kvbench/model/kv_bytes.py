"""KV-cache bytes by method, analytically: the accounting the planner uses, checked against what the engine measures.

The engine measures `kv_bytes` as the storages a cache physically holds (kvbench.model.cache.cache_nbytes). This module
predicts the same number without running the model, from the same rules the code follows:
- tokens kept per layer: `Method.layer_keep_counts` (the very function `Method.compress` evicts by), then the
  appended question and the decoded tokens, which decode-time evictors (H2O, StreamingLLM, decoding) evict again
  by their own `Method.held_after_decoding`;
- KV heads: the model's, or head merging's `kv_heads`;
- storage layout: dense K/V (`kvbench.model.cache.full_cache_nbytes`, the seed's formula), KIVI's packed layout
  (methods/kivi.py docstring), TurboQuant's packed codes (methods/turboquant.py), or transformers' QuantizedCache
  (quanto: an estimate, its packing is opaque);
- layer kinds (kvbench.model.layout, when the shape carries the model's layout): a sliding layer holds its window,
  min(tokens, W − 1), whatever the method (kvbench.model.cache.keep_windows), unless its window never fills in the
  tokens counted (`CacheLayout.at`: then it is compressed as a global layer); a latent layer its latent width (and
  DeepSeek-V3.2's indexer key); a layer reusing another layer's K/V (Gemma 3n) nothing.
tests/plan/test_plan_bytes.py checks predicted == measured for every registered method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.model.cache import full_cache_nbytes
from kvbench.model.layout import CacheLayout

# hf-quant's storage is quanto's (packed data + per-group scale and shift): predicted within this relative error
OPAQUE_TOLERANCE = 0.02


@dataclass(frozen=True)
class KVShape:
    """The terms of the seed's formula: 2 · layers · kv_heads · head_dim · bytes per element (· tokens · batch)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: CacheLayout | None = None  # per-layer kinds and widths; None: every layer global at the formula's width

    def __post_init__(self):
        if self.layout is not None:  # a hybrid's layers that cache K/V (its state layers are the layout's `states`)
            object.__setattr__(self, "n_layers", len(self.layout.layers))

    @classmethod
    def of(cls, lm) -> KVShape:
        """The shape of a loaded model (kvbench.model.load.LoadedModel), its layout included."""
        return cls(lm.n_layers, lm.n_kv_heads, lm.head_dim, lm.dtype, lm.layout)

    def window(self, layer: int) -> int | None:
        """W of a sliding layer (it holds min(tokens, W − 1), dense, whatever the method); None for the others."""
        kind = self.layout.layers[layer] if self.layout is not None else None
        return kind.window if kind is not None and kind.kind == "sliding" else None

    def kept_layer_bytes(self, layer: int, tokens: int, batch: int = 1) -> int:
        """A compressed layer holding `tokens` dense tokens at the layer's own width (latent layers at their latent
        width; expanded latent-attention layers with K and V of different head widths)."""
        if self.layout is not None:
            kind = self.layout.layers[layer]
            return batch * kind.width * tokens * self.element_bytes
        return self.dense_layer_bytes(tokens, batch)

    @property
    def element_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return full_cache_nbytes(self.n_layers, self.n_kv_heads, self.head_dim, 1, self.dtype)

    def dense_layer_bytes(self, tokens: int, batch: int = 1) -> int:
        return batch * full_cache_nbytes(1, self.n_kv_heads, self.head_dim, tokens, self.dtype)


@dataclass(frozen=True)
class Prediction:
    kv_bytes: int  # the whole batch
    exact: bool  # False: an estimate within OPAQUE_TOLERANCE (a backend whose internals are opaque)
    layer_tokens: tuple[int, ...]  # tokens each layer holds at the end
    bound: bool = False  # True: an upper bound (decode-time eviction on KIVI keeps dead tokens of live key groups)


def kivi_layer_bytes(
    shape: KVShape,
    tokens: int,
    key_bits: int,
    group_size: int,
    residual_length: int,
    batch: int = 1,
    value_bits: int | None = None,
) -> int:
    """One KiviLayer holding `tokens` (a function of the count alone: prefill, flushes and `select` all store by
    KIVI's prefill rule). Keys (`key_bits`): whole residual blocks quantized per channel, the rest full precision;
    values (`value_bits`, default `key_bits`): all but the newest residual_length quantized per token; 16 bits keeps
    that part in full precision. Packed words are int32, scales/zeros in the model dtype."""
    heads, dim, elem = batch * shape.n_kv_heads, shape.head_dim, shape.element_bytes
    value_bits = key_bits if value_bits is None else value_bits

    def group_bytes(part_bits: int) -> int:
        return 4 * -(-group_size * part_bits // 32) + 2 * elem  # packed words + scale + zero

    key_tokens = 0 if key_bits == 16 else tokens // residual_length * residual_length
    keys = heads * dim * (key_tokens // group_size) * group_bytes(key_bits) if key_tokens else 0  # groups per channel
    keys += heads * (tokens - key_tokens) * dim * elem
    value_tokens = 0 if value_bits == 16 else max(0, tokens - residual_length)
    values = heads * value_tokens * (dim // group_size) * group_bytes(value_bits) if value_tokens else 0  # per token
    values += heads * (tokens - value_tokens) * dim * elem
    return keys + values


def quanto_layer_bytes(
    shape: KVShape, tokens: int, updates: list[int], nbits: int, group_size: int, residual_length: int, batch: int = 1
) -> int:
    """transformers' QuantizedLayer: the first update quantizes everything; later updates collect a full-precision
    residual until it reaches residual_length, then requantize the whole cache. quanto stores `nbits`-bit codes
    packed into bytes plus one scale and one shift per group in the model dtype (estimate: padding not modelled)."""
    residual = 0
    for n in updates:
        residual = 0 if residual + n >= residual_length else residual + n
    quantized = batch * shape.n_kv_heads * (tokens - residual) * shape.head_dim  # elements, K or V
    per_tensor = quantized * nbits // 8 + 2 * (quantized // group_size) * shape.element_bytes
    return 2 * per_tensor + shape.dense_layer_bytes(residual, batch)


def _parts(method) -> tuple:
    """(structure, eviction, precision) parts of a method, by its declared family (compose: one of each at most)."""
    if method.caps.family == "composite":
        return method.structure, method.eviction, method.precision
    family = method.caps.family
    return (
        method if family == "structure" else None,
        method if family == "eviction" else None,
        method if family == "precision" else None,
    )


def predict_kv_bytes(
    method,
    budget,
    shape: KVShape,
    prompt_tokens: int,
    appended_tokens: int = 0,
    decoded_tokens: int = 0,
    batch: int = 1,
) -> Prediction:
    """Bytes the cache of `batch` requests holds after compressing a `prompt_tokens` prompt with `method` at
    `budget`, appending `appended_tokens` uncompressed (query_aware=false) and feeding `decoded_tokens`."""
    structure, eviction, precision = _parts(method)
    seen = prompt_tokens + appended_tokens + decoded_tokens
    if shape.layout is not None:  # a window that never fills in these tokens grows like a global layer
        shape = KVShape(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, shape.layout.at(seen))
    if structure is not None:
        shape = KVShape(shape.n_layers, structure.kv_heads, shape.head_dim, shape.dtype, shape.layout)
    counts = eviction.layer_keep_counts(prompt_tokens, shape.n_layers, budget) if eviction is not None else None
    evicted = counts is not None
    counts = counts or [prompt_tokens] * shape.n_layers
    tokens, held = [n + appended_tokens + decoded_tokens for n in counts], False
    if eviction is not None:
        tokens, held = eviction.held_after_decoding(counts, prompt_tokens, budget, appended_tokens, decoded_tokens)
    # evicts while decoding (H2O, StreamingLLM, TOVA, decoding)
    stays = (evicted and eviction.caps.evicts_while_decoding) or held
    exact, bound = True, False
    windows = {i: min(seen, w - 1) for i in range(shape.n_layers) if (w := shape.window(i)) is not None}
    tokens = [windows.get(i, t) for i, t in enumerate(tokens)]
    window_bytes = sum(shape.dense_layer_bytes(t, batch) for t in windows.values())
    shared = {i for i in range(shape.n_layers) if shape.layout is not None and shape.layout.layers[i].kind == "shared"}
    tokens = [0 if i in shared else t for i, t in enumerate(tokens)]  # a layer reusing another's K/V holds none
    compressed = [
        (i, t) for i, t in enumerate(tokens) if i not in windows and i not in shared
    ]  # what a method compresses
    if precision is None:
        total = window_bytes + sum(shape.kept_layer_bytes(i, t, batch) for i, t in compressed)
    elif precision.name == "kivi":
        kivi_knobs = (precision.bits_of("key"), precision.group_size, precision.residual_length)
        total = window_bytes + sum(
            kivi_layer_bytes(shape, t, *kivi_knobs, batch, precision.bits_of("value")) for _, t in compressed
        )
        if stays and decoded_tokens:
            # each decode step evicts ≤ 1 token per head; KIVI never re-quantizes, so an evicted token stays stored
            # until its key group empties (methods/kivi.py): ≤ t + decoded stored, residuals ≤ one block each
            fp_block = 2 * batch * shape.n_kv_heads * precision.residual_length * shape.head_dim * shape.element_bytes
            total = window_bytes + sum(
                kivi_layer_bytes(shape, t + decoded_tokens, *kivi_knobs, batch, precision.bits_of("value")) + fp_block
                for _, t in compressed
            )
            exact, bound = False, True
    elif precision.name == "turboquant":  # every token packed on store (methods/turboquant.py); boundary layers dense
        full = precision.full_precision_layers(shape.n_layers)
        total = window_bytes + sum(
            shape.kept_layer_bytes(i, t, batch)
            if i in full
            else batch * precision.layer_bytes(t, shape.n_kv_heads, shape.head_dim, shape.element_bytes, False)
            for i, t in compressed
        )
    elif precision.name == "hf-quant" and precision.backend == "quanto":
        updates = ([appended_tokens] if appended_tokens else []) + [1] * decoded_tokens
        total = window_bytes + sum(
            quanto_layer_bytes(
                shape, t, updates, precision.nbits, precision.q_group_size, precision.residual_length, batch
            )
            for _, t in compressed
        )
        exact = False
    else:
        raise KvbenchError(
            f"no byte accounting for {precision.name} {precision.params().get('backend', '')}; "
            "the planner supports kivi, turboquant and hf-quant backend=quanto"
        )
    states = shape.layout.state_bytes(batch) if shape.layout is not None else 0  # a hybrid's, kept whatever the method
    return Prediction(total + states, exact, tuple(tokens), bound)
