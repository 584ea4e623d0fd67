"""Ragged KV heads: each (sequence, KV head) keeps its own number of tokens, stored flat — physically.

Head-wise budgets (AdaKV) give the KV heads of a layer different lengths. Padding them back to (B, H_kv, T_max, D)
or masking would hold the full-size tensors; here a layer stores `flat_keys`/`flat_values` (Σ T_bh, D) with the
segments in (batch, head) order, positions ascending inside each, and the lengths T_bh as plain integers (shape
metadata, like a dense tensor's shape). `update` appends each segment's new tokens at its end; attention runs per
segment (`ragged_attention`: a pure-torch reference; a Triton decode kernel on CUDA, kernels/triton/ragged.py) and
is dispatched by kvbench's attention function when the cache hands it a `RaggedKV` instead of a dense tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from kvbench import KvbenchError


@dataclass
class RaggedKV:
    """What a ragged layer hands the attention function: flat (Σ T_bh, D) tensors and the segment lengths."""

    flat: torch.Tensor
    lengths: list[int]
    bsz: int
    n_heads: int

    def segments(self) -> tuple[torch.Tensor, ...]:
        return torch.split(self.flat, self.lengths)  # each (T_bh, D), views


class RaggedLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, flat_keys: torch.Tensor, flat_values: torch.Tensor, lengths: list[int], bsz: int, n_heads: int):
        self.flat_keys, self.flat_values = flat_keys, flat_values  # (Σ T_bh, D) each
        self.lengths, self.bsz, self.n_heads = list(lengths), bsz, n_heads
        self.is_initialized = True
        self.device = flat_keys.device

    @classmethod
    def gather(cls, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> RaggedLayer:
        """Keep `keep` (B, H_kv, T) bool of keys/values (B, H_kv, T, D): new flat tensors of the kept rows only."""
        bsz, n_heads, _, head_dim = keys.shape  # (B, H_kv, T, D)
        rows = keep.reshape(-1).nonzero().squeeze(1)  # (N,): (b, h, t) row-major = segment order, t ascending
        lengths = keep.sum(-1).reshape(-1).tolist()  # B·H_kv segment lengths
        flat_keys = keys.reshape(-1, head_dim).index_select(0, rows)  # (N, D)
        flat_values = values.reshape(-1, head_dim).index_select(0, rows)  # (N, D)
        return cls(flat_keys, flat_values, lengths, bsz, n_heads)

    @property
    def keys(self):
        raise KvbenchError(
            "this cache layer holds KV heads of different lengths (adakv) and no dense keys; "
            "use it with the engine's own decoding, not with dense-cache consumers (compose, ppl)"
        )

    values = keys

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append key/value states (B, H_kv, Q, D) at the end of every segment; returns RaggedKV for attention."""
        n_new = key_states.shape[2]
        new_keys = key_states.reshape(-1, n_new, key_states.shape[-1])  # (B·H_kv, Q, D)
        new_values = value_states.reshape(-1, n_new, value_states.shape[-1])  # (B·H_kv, Q, D)
        old_keys = torch.split(self.flat_keys, self.lengths)
        old_values = torch.split(self.flat_values, self.lengths)
        self.flat_keys = torch.cat([t for pair in zip(old_keys, new_keys) for t in pair])  # (Σ T_bh + B·H·Q, D)
        self.flat_values = torch.cat([t for pair in zip(old_values, new_values) for t in pair])
        self.lengths = [n + n_new for n in self.lengths]
        return (
            RaggedKV(self.flat_keys, self.lengths, self.bsz, self.n_heads),
            RaggedKV(self.flat_values, self.lengths, self.bsz, self.n_heads),
        )

    def get_seq_length(self) -> int:
        return max(self.lengths)  # the longest head (masks are built for it; ragged attention needs none)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """transformers ≥ 5.3 passes the query length, 5.2 the query's cache positions (1-D tensor)."""
        n_queries = query_length if isinstance(query_length, int) else query_length.shape[0]
        return self.get_seq_length() + n_queries, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # abstract in transformers 5.2's CacheLayerMixin: unbounded
        return -1

    def head_lengths(self) -> torch.Tensor:
        """(B, H_kv) tokens held per head."""
        return torch.tensor(self.lengths).view(self.bsz, self.n_heads)


def ragged_attention(query: torch.Tensor, key: RaggedKV, value: RaggedKV, scaling: float) -> torch.Tensor:
    """Attention over ragged heads, (B, Q, H_q, D): the Triton decode kernel on CUDA for one query per sequence
    (unless KVBENCH_NO_TRITON=1), the torch reference otherwise."""
    from kvbench.kernels import fast_module

    fast = fast_module(query, "ragged") if query.shape[2] == 1 else None
    if fast:
        out = fast.triton_ragged_decode(query[:, :, 0], key.flat, value.flat, key.lengths, key.n_heads, scaling)
        return out[:, None]  # (B, 1, H_q, D) from (B, H_q, D)
    return ragged_attention_reference(query, key, value, scaling)


def ragged_attention_reference(query: torch.Tensor, key: RaggedKV, value: RaggedKV, scaling: float) -> torch.Tensor:
    """Causal softmax attention of query (B, H_q, Q, D) — the last Q positions of every segment — over each KV
    head's own keys; GQA: query head h reads KV head h // G. Returns (B, Q, H_q, D) as transformers' sdpa does.
    The pure-torch reference: one (G, Q, T_bh) score block per segment, fp32 softmax."""
    _, n_q_heads, n_queries, _ = query.shape  # (B, H_q, Q, D)
    group = n_q_heads // key.n_heads
    out = torch.empty_like(query)  # (B, H_q, Q, D)
    for segment, (k, v) in enumerate(zip(key.segments(), value.segments())):
        b, h = divmod(segment, key.n_heads)
        q = query[b, h * group : (h + 1) * group]  # (G, Q, D)
        scores = torch.matmul(q.float(), k.float().T) * scaling  # (G, Q, T_bh)
        n_keys = k.shape[0]
        future = (
            torch.arange(n_keys, device=q.device)[None, :]
            > (n_keys - n_queries + torch.arange(n_queries, device=q.device))[:, None]
        )
        scores.masked_fill_(future, float("-inf"))  # (Q, T_bh) causal among the appended queries
        out[b, h * group : (h + 1) * group] = torch.matmul(scores.softmax(-1), v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous()  # (B, Q, H_q, D)
