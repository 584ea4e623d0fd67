"""sdpa attention that can also record the statistics eviction methods need, without eager attention.

Registered with transformers' `AttentionInterface` as "kvbench_stats". The attention output comes from transformers'
own sdpa function (from the model's own eager function when the model soft-caps its logits, which sdpa cannot); only
while a `StatsRecorder` is active (see `recording`) does this function also compute column sums of softmax(QKᵀ) from
the post-RoPE Q and the layer's cached K, in chunks, under the same mask (sliding windows) and soft cap.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench import KvbenchError
from kvbench.kernels import attention_column_sums
from kvbench.kernels.backend import backend
from kvbench.model.padded import PaddedKV
from kvbench.model.ragged import RaggedKV, ragged_attention

# not "…sdpa…": transformers refuses any implementation named so for models without sdpa support (Gemma-2, whose
# soft-capped logits this function sends to the model's own eager attention)
ATTN_IMPLEMENTATION = "kvbench_stats"
# model types whose attention reads the cache's tensors itself instead of going through transformers'
# AttentionInterface (transformers 5.2's Falcon): no statistics recorded there, no buffers read through it
NO_ATTENTION_INTERFACE = ("falcon",)


@dataclass(frozen=True)
class StatsRequest:
    """What a forward pass must record. Requests from several methods merge with `|` (shared prefill)."""

    windows: frozenset[int] = frozenset()  # observation windows W: attention of the last W queries onto each key
    all_queries: bool = False  # attention of every query onto each key (H2O's accumulated scores)
    # pre-RoPE query moments (Expected Attention), one per number of leading (sink) positions left out
    query_moments: frozenset[int] = frozenset()

    def __or__(self, other: StatsRequest) -> StatsRequest:
        return StatsRequest(
            self.windows | other.windows,
            self.all_queries or other.all_queries,
            self.query_moments | other.query_moments,
        )

    def __bool__(self) -> bool:
        return bool(self.windows) or self.all_queries or bool(self.query_moments)


@dataclass
class StatsRecorder:
    """Per-layer statistics of one forward pass, each (B, H_q, T_keys) fp32.

    `window[W][layer]`: column sums over the last W queries; `all_queries[layer]`: over every query of the pass.
    `moments[S][layer]`: `QueryMoments` of the pre-RoPE queries at positions ≥ S (accumulated over calls).
    """

    request: StatsRequest
    window: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    all_queries: dict[int, torch.Tensor] = field(default_factory=dict)
    moments: dict[int, dict[int, QueryMoments]] = field(default_factory=dict)
    # seconds spent computing each statistic ("all" or the window size W): a shared prefill charges each
    # configuration only the statistics its own method asked for
    seconds: dict = field(default_factory=dict)
    # set by Engine.prefill when it prefilled a whole prompt (None after a reused prefix): methods that re-read the
    # prompt (kvzip's reconstruction forward) find the model, the token ids and the per-layer (keys, values) here
    prompt: PromptSource | None = None

    def record(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        scaling: float,
        mask: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> None:
        """query (B, H_q, Q, D), key (B, H_kv, T, D); mask: the model's (B|1, 1|H_q, Q, T) mask, None = causal."""
        n_queries = query.shape[2]
        for w in self.request.windows:
            with self._timed(w):
                window_q = query[:, :, -min(w, n_queries) :]  # (B, H_q, W, D)
                window_mask = None if mask is None else mask[:, :, -window_q.shape[2] :]  # (B|1, 1|H_q, W, T)
                self.window.setdefault(w, {})[layer_idx] = attention_column_sums(
                    window_q, key, scaling, window_mask, softcap
                )
        if self.request.all_queries:
            with self._timed("all"):
                if self.request.windows and n_queries == 1:  # a single query: every window sees the same row
                    self.all_queries[layer_idx] = next(iter(self.window.values()))[layer_idx]
                else:
                    self.all_queries[layer_idx] = attention_column_sums(query, key, scaling, mask, softcap)

    def record_decode_step(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """One query (B, H_q, 1, D), no mask: record its attention row as every requested statistic and return the
        attention output (B, 1, H_q, D) computed from the same probabilities (kvbench/kernels/attention_stats.py)."""
        output, row = self.decode_step(query, key, value, scaling)  # row: (B, H_q, T)
        self.store_decode_row(layer_idx, row)
        return output

    def decode_step(self, query, key, value, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused decode step, timed as the statistic it records: output (B, 1, H_q, D), row (B, H_q, T)."""
        from kvbench.kernels.attention_stats import decode_attention_with_probs

        with self._timed("all" if self.request.all_queries else next(iter(self.request.windows))):
            return decode_attention_with_probs(query, key, value, scaling)

    def store_decode_row(self, layer_idx: int, row: torch.Tensor) -> None:
        """A single query's attention row (B, H_q, T) is every requested statistic of that step."""
        for w in self.request.windows:
            self.window.setdefault(w, {})[layer_idx] = row
        if self.request.all_queries:
            self.all_queries[layer_idx] = row

    def record_query_moments(self, module, query: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Accumulate Σq and Σqqᵀ of the pre-RoPE queries (the post-RoPE ones rotated back by their positions)."""
        from kvbench.model.rope import rerotate

        with self._timed("moments"):
            if position_ids is None:  # Llama-style decoder layers pass them through to the attention call
                raise KvbenchError("query moments need position_ids in the attention call (Llama-style models)")
            positions = position_ids[0].to(query.device)  # (Q,)
            inv_freq, scaling = rope_of(module)
            inv_freq = inv_freq.to(query.device)
            pre_rope = rerotate(query.float(), -positions, inv_freq) / scaling  # (B, H_q, Q, D)
            for skip in self.request.query_moments:
                kept = pre_rope[:, :, positions >= skip]  # (B, H_q, N, D)
                bsz, n_heads, _, head_dim = query.shape  # (B, H_q, Q, D)
                moments = self.moments.setdefault(skip, {}).setdefault(
                    cache_index(module), QueryMoments.empty(bsz, n_heads, head_dim, inv_freq, scaling)
                )
                moments.add(kept)

    def has_layer(self, layer_idx: int) -> bool:
        """Whether every statistic the request asks for was recorded for this layer (in this pass)."""
        request = self.request
        return (
            (not request.all_queries or layer_idx in self.all_queries)
            and all(layer_idx in self.window.get(w, {}) for w in request.windows)
            and all(layer_idx in self.moments.get(s, {}) for s in request.query_moments)
        )

    def release(self, layer_idx: int) -> None:
        """Drop one layer's statistics once they are used (prefill=inline: one layer's at a time)."""
        self.all_queries.pop(layer_idx, None)
        for windows in self.window.values():
            windows.pop(layer_idx, None)
        for moments in self.moments.values():
            moments.pop(layer_idx, None)

    @contextlib.contextmanager
    def _timed(self, name):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def seconds_for(self, request: StatsRequest) -> float:
        """Time spent on the statistics `request` needs (CPU wall time; GPU kernels are asynchronous)."""
        return (
            sum(self.seconds.get(w, 0.0) for w in request.windows)
            + (self.seconds.get("all", 0.0) if request.all_queries else 0.0)
            + (self.seconds.get("moments", 0.0) if request.query_moments else 0.0)
        )


@dataclass
class Derived:
    value: object
    seconds: float  # what deriving it took
    peak_bytes: int  # the peak memory while it was derived


@dataclass
class PromptSource:
    """The prefilled prompt, and what methods derive from it after the prefill (kvzip's reconstruction scores).

    `derive(key, compute)` computes a value once per prefill: the configurations of a grid (and their fidelity
    rebuilds) that ask for the same key share it. Each is charged as if it had derived its own: `charge_since`
    gives the seconds and the peak a stretch of work (one configuration's compression) used without paying."""

    lm: object  # kvbench.model.load.LoadedModel
    ids: list[int]
    kv: list  # per layer (keys, values) (B, H_kv, T, D), the prefill's own tensors
    # the engine's device clock: synchronize() before reading the time, peak() the peak memory since its reset
    synchronize: Callable[[], None] = lambda: None
    peak: Callable[[], int] = lambda: 0
    derived: dict = field(default_factory=dict)  # key → Derived
    used: list = field(default_factory=list)  # every Derived handed out, in order
    computed: list = field(default_factory=list)  # every Derived computed, in order

    def derive(self, key, compute: Callable[[], object]):
        if key not in self.derived:
            self.synchronize()
            start = time.perf_counter()
            value = compute()
            self.synchronize()
            self.derived[key] = Derived(value, time.perf_counter() - start, self.peak())
            self.computed.append(self.derived[key])
        self.used.append(self.derived[key])
        return self.derived[key].value

    def mark(self) -> tuple[int, int]:
        return len(self.used), len(self.computed)

    def charge_since(self, mark: tuple[int, int]) -> tuple[float, int]:
        """(seconds, peak bytes) to add to a stretch of work begun at `mark`: each derivation it used (once, however
        many layers asked) and did not compute (a stretch that computed one already paid for it)."""
        used = {id(d): d for d in self.used[mark[0] :]}
        reused = [d for d in used.values() if all(d is not c for c in self.computed[mark[1] :])]
        return sum(d.seconds for d in reused), max((d.peak_bytes for d in used.values()), default=0)


@dataclass
class QueryMoments:
    """Running sums of pre-RoPE queries per query head: count N, Σq (B, H_q, D), Σqqᵀ (B, H_q, D, D), fp32;
    with the model's RoPE (inv_freq (D/2,), attention scaling) to carry them to other positions."""

    count: int
    total: torch.Tensor
    outer: torch.Tensor
    inv_freq: torch.Tensor
    rope_scaling: float

    @classmethod
    def empty(cls, bsz: int, n_heads: int, head_dim: int, inv_freq: torch.Tensor, rope_scaling: float):
        device = inv_freq.device
        return cls(
            0,
            torch.zeros(bsz, n_heads, head_dim, device=device),
            torch.zeros(bsz, n_heads, head_dim, head_dim, device=device),
            inv_freq,
            rope_scaling,
        )

    def add(self, queries: torch.Tensor) -> None:
        """queries (B, H_q, N, D) fp32."""
        self.count += queries.shape[2]
        self.total += queries.sum(2)  # (B, H_q, D)
        self.outer += torch.einsum("bhnd,bhne->bhde", queries, queries)  # (B, H_q, D, D)

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean (B, H_q, D) and population covariance (B, H_q, D, D) (kvpress divides by N)."""
        mean = self.total / self.count
        return mean, self.outer / self.count - mean[..., :, None] * mean[..., None, :]


def rope_of(module) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) of an attention module's model, from its family's rotary embedding class
    built on the module's config (the attention call does not receive cos/sin); kept on the module per dtype. A
    model with a RoPE per layer type (Gemma 3: `sliding_attention_inv_freq`, `full_attention_inv_freq`) gives the
    module's own layer type's."""
    dtype = next(module.parameters()).dtype
    cached = getattr(module, "_kvbench_rope", None)
    if cached is None or cached[0] != dtype:
        import sys

        family = sys.modules[type(module).__module__]
        rotary = [
            cls for name, cls in vars(family).items() if name.endswith("RotaryEmbedding") and isinstance(cls, type)
        ]
        if not rotary:
            raise KvbenchError(
                f"{type(module).__name__} has no rotary embedding class beside it; query moments "
                f"(expected_attention) need a RoPE model"
            )
        embedding = rotary[0](module.config)
        prefix = ""  # one RoPE for the model, else the module's layer type's (Gemma 3)
        if not hasattr(embedding, "inv_freq"):
            prefix = f"{module.config.layer_types[module.layer_idx]}_"
        # the model's own buffer was cast with its weights (model.to(bfloat16) rounds inv_freq, and RoPE then uses
        # the rounded values): round the same way, or positions far from 0 rotate back by the wrong angle
        inv_freq = getattr(embedding, f"{prefix}inv_freq").to(dtype).float()
        scaling = float(getattr(embedding, f"{prefix}attention_scaling", 1.0))
        module._kvbench_rope = cached = (dtype, inv_freq, scaling)
    return cached[1], cached[2]


_active = threading.local()


def cache_index(module) -> int:
    """The cache layer an attention module's statistics belong to: its decoder layer, or in a hybrid model its place
    among the attention layers (`kvbench_cache_index`, set when the model loads: kvbench.model.loaded.finish)."""
    return getattr(module, "kvbench_cache_index", module.layer_idx)


@contextlib.contextmanager
def after_each_layer(hook):
    """Call `hook(layer_idx, keys, values)` at the end of every attention call inside the block, with the layer's
    whole cached K/V (B, H_kv, T, D) — `prefill=inline` compresses each layer there (kvbench.native.inline). Inside the
    block a layer may hold fewer tokens than the mask the model built from layer 0 (PyramidKV's per-layer counts
    while prefilling in chunks): such a layer gets the bottom-right-aligned causal mask of its own length."""
    previous = getattr(_active, "layer_hook", None)
    _active.layer_hook = hook
    try:
        yield
    finally:
        _active.layer_hook = previous


def _own_length_mask(attention_mask, query: torch.Tensor, key: torch.Tensor):
    """A chunk's causal mask for a layer holding key.shape[2] tokens when the model's mask covers another length:
    query i (of Q, the newest) sees every key up to T − Q + i, as (1, 1, Q, T) bool."""
    n_queries, n_keys = query.shape[2], key.shape[2]
    if attention_mask is None or attention_mask.shape[-1] == n_keys:
        return attention_mask
    positions = torch.arange(n_keys, device=query.device)
    return (positions[None, :] <= positions[n_keys - n_queries :, None])[None, None]  # (1, 1, Q, T)


@contextlib.contextmanager
def recording(request: StatsRequest, recorder: StatsRecorder | None = None):
    """Record `request`'s statistics for every attention call inside the block; yields the recorder (`recorder`:
    a StatsRecorder of one's own, e.g. one that records some batch rows only: kvbench.native.grid_decode)."""
    recorder = recorder if recorder is not None else StatsRecorder(request)
    previous = getattr(_active, "recorder", None)
    _active.recorder = recorder if request else None
    try:
        yield recorder
    finally:
        _active.recorder = previous


def kvbench_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention signature (sdpa_attention_forward's: `dropout` may come positionally, as kvpress's
    attention patch passes it; inference ignores it): query (B, H_q, Q, D); key/value (B, H_kv, T, D) from the
    cache."""
    hook = getattr(_active, "layer_hook", None)
    if hook is not None:
        if hasattr(key, "attend"):  # a quantized layer's view of its storage (chunked prefill into KIVI): dense K/V
            key, value = key.kv()
        attention_mask = _own_length_mask(attention_mask, query, key)
    output = _attention(module, query, key, value, attention_mask, scaling, **kwargs)
    if hook is not None:
        hook(cache_index(module), key, value)  # the output is computed: the layer's full K/V may now go
    return output


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    recorder = getattr(_active, "recorder", None)
    if isinstance(key, PaddedKV):  # configurations decoded as one batch (kvbench.native.grid_decode)
        if key.lengths is not None and query.shape[2] == 1 and _fused_ok(recorder, kwargs):
            return _rows_attention(module, query, key, value, scaling, recorder, **kwargs), None
        key, value, attention_mask = key.dense(), value.dense(), key.pad_mask()  # pads masked out
    if hasattr(key, "attend"):  # a cache layer's view of its own storage (KIVI's packed groups, methods/kivi.py)
        if recorder is None and query.shape[2] == 1 and attention_mask is None and kwargs.get("softcap") is None:
            out = key.attend(query, scaling if scaling is not None else query.shape[-1] ** -0.5)
            if out is not None:  # None: nothing is quantized, the dense path below is exact
                return out, None
        key, value = key.kv()  # (B, H_kv, T, D) dequantized: statistics, masks and several queries go through sdpa
    if isinstance(key, RaggedKV):  # KV heads of different lengths (adakv): per-head attention, no statistics
        if recorder is not None:
            raise KvbenchError("attention statistics over ragged (adakv) cache layers are not supported")
        return ragged_attention(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5), None
    if recorder is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        # a plain decode step recording a single query's row (H2O, TOVA): one softmax for output and stats
        if (
            type(recorder) is StatsRecorder
            and query.shape[2] == 1
            and attention_mask is None
            and _fused_ok(recorder, kwargs)
        ):
            return recorder.record_decode_step(cache_index(module), query, key, value, scale), None
        mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]  # (B|1, 1|H_q, Q, T)
        recorder.record(cache_index(module), query, key, scale, mask, kwargs.get("softcap"))
        if recorder.request.query_moments:
            recorder.record_query_moments(module, query, kwargs.get("position_ids"))
    return _plain_attention(module, query, key, value, attention_mask, scaling, **kwargs)


def _plain_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The model's attention on dense K/V: transformers' sdpa, or the model's eager function for soft-capped logits."""
    model_code = sys.modules[type(module).__module__]  # the model's own modeling file
    if key.shape[1] == query.shape[1] != getattr(module.config, "num_key_value_heads", key.shape[1]):
        # a cache holding one K/V head per query head (snapkv aggregate=none, the original's layout): no GQA repeat
        module = SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cpu = backend("cpu") if attention_mask is None else None
    if cpu is not None and _single_query_ok(key, kwargs):  # a decode step the C kernel takes (it checks the tensors)
        out = cpu.decode_attention(query, key, value, scale)
        if out is not None:
            return out, None
    if kwargs.get("softcap") is not None:  # sdpa cannot cap logits: the model's own eager attention (Gemma-2)
        n_queries, n_keys = query.shape[2], key.shape[2]
        if attention_mask is None:  # sdpa's mask functions leave plain causal masks to is_causal; eager needs one
            positions = torch.arange(n_keys, device=query.device)
            attention_mask = positions[None, :] <= positions[n_keys - n_queries :, None]  # (Q, T)
        if attention_mask.dtype == torch.bool:  # eager adds its mask
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attention_mask, torch.finfo(query.dtype).min
            )
        return model_code.eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _single_query_ok(key, kwargs) -> bool:
    """Whether the model's options let the CPU backend's decode attention (kernels/cpu/single_query.py: one query
    per row, CPU, fp32/bf16 — it checks the tensors itself) take this step: no soft cap, sinks or dropout, no sliding
    window shorter than the cache. The same kernel for a decode alone and for a grid's rows, whose outputs it keeps
    row-independent."""
    window = kwargs.get("sliding_window")
    return (
        kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and not kwargs.get("dropout")
        and (window is None or key.shape[2] <= window)  # longer: the model's mask decides, not all the slots
    )


def _fused_ok(recorder: StatsRecorder | None, kwargs) -> bool:
    """Whether a single-query step's statistics can come from its own softmax (the fused decode step): no soft cap,
    no query moments (they need the query itself, not its row)."""
    return kwargs.get("softcap") is None and (recorder is None or not recorder.request.query_moments)


def _rows_attention(module, query, key: PaddedKV, value: PaddedKV, scaling, recorder, **kwargs) -> torch.Tensor:
    """A grid decode step (kvbench.native.grid_decode): each row attends over its own tokens by the very call a batch-1
    decode makes, so its output has the bits it has alone — one sdpa over the padded, masked batch rounds
    differently (enough to flip a greedy token in bf16). The rows recording statistics (`recorder.rows`, a
    grid_decode.RowsRecorder) take the fused decode step and their rows are stored stacked, zero past each row's
    length. Returns (B, 1, H_q, D)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    asking = list(getattr(recorder, "rows", [])) if recorder is not None else []
    lengths = cast(list[int], key.lengths)
    together = None  # the C kernel's rows, computed in one call (the asking rows get 0 tokens there: no work)
    cpu = backend("cpu")
    if cpu is not None and _single_query_ok(key.tensor, kwargs):
        own = [0 if row in asking else n for row, n in enumerate(lengths)]
        together = cpu.decode_attention(query, key.tensor, value.tensor, scale, own)  # (B, 1, H_q, D)
    outputs, recorded = [], []
    for row, n_tokens in enumerate(lengths):
        if together is not None and row not in asking:
            continue  # its output is the kernel's row: what the kernel gives this row alone
        q = query[row : row + 1]  # (1, H_q, 1, D)
        k, v = key.tensor[row : row + 1, :, :n_tokens], value.tensor[row : row + 1, :, :n_tokens]  # (1, H_kv, n, D)
        if row in asking:
            assert recorder is not None  # rows ask only through a recorder
            out, probs = recorder.decode_step(q, k, v, scale)  # (1, 1, H_q, D), (1, H_q, n)
            recorded.append(probs)
        else:
            out = _plain_attention(module, q, k, v, None, scaling, **kwargs)[0]  # (1, 1, H_q, D)
        if together is not None:
            together[row] = out[0]  # the kernel left it empty (0 tokens)
        outputs.append(out)
    if recorded:
        width = max(lengths)
        rows = torch.stack([torch.nn.functional.pad(p[0], (0, width - p.shape[-1])) for p in recorded])  # (B_r, H_q, T)
        recorder.store_decode_row(cache_index(module), rows)
    return together if together is not None else torch.cat(outputs)  # (B, 1, H_q, D)


def register() -> str:
    """Make "kvbench_stats" usable as `attn_implementation` (attention and mask functions); idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbench_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
