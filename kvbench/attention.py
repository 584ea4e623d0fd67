"""sdpa attention that can also record the statistics eviction methods need, without eager attention.

Registered with transformers' `AttentionInterface` as "kvbench_sdpa". The attention output always comes from
transformers' own sdpa function; only while a `StatsRecorder` is active (see `recording`) does this function also
compute column sums of softmax(QKᵀ) from the post-RoPE Q and the layer's cached K, in chunks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.kernels import attention_column_sums

ATTN_IMPLEMENTATION = "kvbench_sdpa"


@dataclass(frozen=True)
class StatsRequest:
    """What a forward pass must record. Requests from several methods merge with `|` (shared prefill)."""

    windows: frozenset[int] = frozenset()  # observation windows W: attention of the last W queries onto each key
    all_queries: bool = False  # attention of every query onto each key (H2O's accumulated scores)

    def __or__(self, other: "StatsRequest") -> "StatsRequest":
        return StatsRequest(self.windows | other.windows, self.all_queries or other.all_queries)

    def __bool__(self) -> bool:
        return bool(self.windows) or self.all_queries


@dataclass
class StatsRecorder:
    """Per-layer statistics of one forward pass, each (B, H_q, T_keys) fp32.

    `window[W][layer]`: column sums over the last W queries; `all_queries[layer]`: over every query of the pass.
    """

    request: StatsRequest
    window: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    all_queries: dict[int, torch.Tensor] = field(default_factory=dict)
    # seconds spent computing each statistic ("all" or the window size W): a shared prefill charges each
    # configuration only the statistics its own method asked for
    seconds: dict = field(default_factory=dict)

    def record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        n_queries = query.shape[2]
        for w in self.request.windows:
            with self._timed(w):
                window_q = query[:, :, -min(w, n_queries) :]  # (B, H_q, W, D)
                self.window.setdefault(w, {})[layer_idx] = attention_column_sums(window_q, key, scaling)
        if self.request.all_queries:
            with self._timed("all"):
                if self.request.windows and n_queries == 1:  # a single query: every window sees the same row
                    self.all_queries[layer_idx] = next(iter(self.window.values()))[layer_idx]
                else:
                    self.all_queries[layer_idx] = attention_column_sums(query, key, scaling)

    @contextlib.contextmanager
    def _timed(self, name):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def seconds_for(self, request: StatsRequest) -> float:
        """Time spent on the statistics `request` needs (CPU wall time; GPU kernels are asynchronous)."""
        return sum(self.seconds.get(w, 0.0) for w in request.windows) + (
            self.seconds.get("all", 0.0) if request.all_queries else 0.0)


_active = threading.local()


@contextlib.contextmanager
def recording(request: StatsRequest):
    """Record `request`'s statistics for every attention call inside the block; yields the recorder."""
    recorder = StatsRecorder(request)
    previous = getattr(_active, "recorder", None)
    _active.recorder = recorder if request else None
    try:
        yield recorder
    finally:
        _active.recorder = previous


def kvbench_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention signature: query (B, H_q, Q, D); key/value (B, H_kv, T, D) from the cache."""
    recorder = getattr(_active, "recorder", None)
    if recorder is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        recorder.record(module.layer_idx, query, key, scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def register() -> str:
    """Make "kvbench_sdpa" usable as `attn_implementation` (attention and mask functions); idempotent."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvbench_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
