"""R-KV — redundancy-aware eviction for reasoning traces (Cai et al. 2025, https://arxiv.org/abs/2505.24133;
Zefan-Cai/R-KV rkv/compression/r1_kv.py, and its kvpress-style press).

A token's score mixes importance and redundancy: λ · a − (1 − λ) · r. Importance a: the attention the last
`window_size` queries pay it (softmax over all keys, averaged over the window's queries and the KV head's query
group, as the kvpress-style press computes it; the R-KV code softmaxes over the keys before the window, which column
sums cannot reproduce), max-pooled over `kernel_size` positions. Redundancy r: each key's cosine similarity to the
layer's other keys (same KV head), the diagonal zeroed; for each key, its similarity to one similar key (cosine >
`similarity_threshold`: the latest, `retain_direction=last`, or the earliest) is zeroed as well — the copy to keep —
then the mean over the keys, softmaxed over the keys. A key with many near-duplicates scores low and goes first.
The last `window_size` tokens are always kept; each KV head keeps its top scores of the rest.

At the prompt this selects down to the budget; while decoding it holds every layer at that size
(methods/decode_eviction.py): the window statistic is then the attention rows of the last `window_size` decode
steps (each aligned to the cache as it shrinks), the redundancy that of the keys held. `evict_every=k` evicts k
tokens every k steps (the R-KV code compresses every `divide_length` = 128 steps: evict_every=128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, check_choice, top_k_sorted
from kvbench.methods.decode_eviction import DecodeEviction, Evicting
from kvbench.methods.scorers import per_kv_head
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import held_kv


def redundancy(keys: torch.Tensor, threshold: float = 0.5, retain_direction: str = "last") -> torch.Tensor:
    """(B, H_kv, T, D) keys → (B, H_kv, T) redundancy: mean cosine similarity to the other keys, one similar key's
    (the one retained) left out, softmaxed over the keys (R-KV's cal_similarity), one head at a time."""
    bsz, n_heads, n_tokens, _ = keys.shape
    out = keys.new_empty(bsz, n_heads, n_tokens, dtype=torch.float32)
    position = torch.arange(n_tokens, device=keys.device)
    for b in range(bsz):
        for h in range(n_heads):
            k = keys[b, h].float()
            k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)  # (T, D)
            sim = k @ k.T  # (T, T) cosine
            sim.fill_diagonal_(0.0)
            similar = sim > threshold  # (T, T)
            if retain_direction == "last":  # the latest similar key (R-KV: 0 when none, as its code does)
                retain = torch.where(similar, position, 0).amax(-1)  # (T,)
                sim[position, retain] = 0.0
            else:  # the earliest similar key; rows with none keep theirs
                first = torch.where(similar, position, n_tokens).amin(-1)  # (T,)
                rows = first < n_tokens
                sim[position[rows], first[rows]] = 0.0
            out[b, h] = sim.mean(-1).softmax(-1)  # (T,)
    return out


class RKVCompression(Evicting):
    """One example's R-KV while decoding: per layer the last decode steps' attention rows (the window's votes)."""

    method: RKV

    def __init__(self, method: RKV, n_prompt: int, n_layers: int, budget):
        super().__init__(method, n_prompt, n_layers, budget)
        self.rows: dict[int, list[torch.Tensor]] = {}  # layer → the last decode steps' attention rows (B, H_q, T)

    def observe_step(self, layer_idx, layer, stats):
        """Remember this step's attention row; the older rows get a zero for the new token (causal)."""
        window = self.method.window_size
        row = stats.window[window][layer_idx]  # (B, H_q, T): the single decode query's softmax row
        rows = [F.pad(r, (0, row.shape[-1] - r.shape[-1])) for r in self.rows.get(layer_idx, [])]
        self.rows[layer_idx] = (rows + [row])[-window:]

    def decode_keep(self, layer_idx, layer, size, stats):
        keys, _ = held_kv(layer)  # (B, H_kv, T, D)
        rows = self.rows[layer_idx]
        votes = torch.stack(rows).sum(0) / len(rows)  # (B, H_q, T) mean over the remembered queries
        index = self.method.window_keep(votes, keys, size)  # (B, H_kv, size)
        group = rows[0].shape[1] // keys.shape[1]
        per_query = index.repeat_interleave(group, dim=1)  # (B, H_q, size)
        self.rows[layer_idx] = [r.gather(-1, per_query) for r in rows]  # the rows follow the kept tokens
        return index


@METHODS.register("rkv")
@dataclass
class RKV(DecodeEviction):
    window_size: int = knob(8, min=1, tokens=True)  # the newest tokens: always kept, their queries vote (R-KV: 8)
    kernel_size: int = knob(7, min=1)  # max pooling of the votes, odd (R-KV: 7)
    mix_lambda: float = knob(0.1, max=1.0)  # λ: importance weight; 1 − λ on redundancy (R-KV: 0.1)
    similarity_threshold: float = knob(0.5, min=-1.0, max=1.0)  # cosine above which two keys are similar
    retain_direction: str = knob("last", choices=("last", "first"))  # which similar key is not held against a key

    # the decode window is single decode queries; a streamed chunk's votes are a whole window's
    caps = Capabilities(evicts_while_decoding=True, stream_limit="use snapkv or h2o")
    compression = RKVCompression

    def __post_init__(self):
        super().__post_init__()  # evict_every
        check_choice("retain_direction", self.retain_direction, ("last", "first"))
        if self.kernel_size % 2 == 0:
            raise KvbenchError(f"kernel_size={self.kernel_size}: use an odd pooling kernel (R-KV's 7), centred")
        if not 0 <= self.mix_lambda <= 1:
            raise KvbenchError(f"mix_lambda={self.mix_lambda}: must be in [0, 1]")

    def stats_request(self) -> StatsRequest:
        return StatsRequest(windows=frozenset({self.window_size}))

    def min_tokens(self) -> int:
        return self.window_size + 1

    def mixed_scores(self, votes: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """votes (B, H_q, T): attention averaged over the window's queries; keys (B, H_kv, T, D) → (B, H_kv, T − W):
        λ · pooled importance − (1 − λ) · redundancy of the tokens before the window."""
        n_before = keys.shape[2] - self.window_size
        importance = per_kv_head(votes.float(), keys.shape[1], "mean")[..., :n_before]  # (B, H_kv, T − W)
        importance = F.max_pool1d(importance, self.kernel_size, stride=1, padding=self.kernel_size // 2)
        similar = redundancy(keys, self.similarity_threshold, self.retain_direction)[..., :n_before]
        return self.mix_lambda * importance - (1 - self.mix_lambda) * similar  # (B, H_kv, T − W)

    def window_keep(self, votes: torch.Tensor, keys: torch.Tensor, n_keep: int) -> torch.Tensor:
        n_tokens = keys.shape[2]
        chosen = top_k_sorted(self.mixed_scores(votes, keys), n_keep - self.window_size)  # (B, H_kv, n − W)
        window = torch.arange(n_tokens - self.window_size, n_tokens, device=keys.device)
        return torch.cat([chosen, window.expand(*chosen.shape[:2], -1)], dim=-1)  # (B, H_kv, n_keep)

    def scores(self, layer_idx, keys, values, stats):
        """The mixed scores, +inf on the window: what adakv, chunkkv and kvcrush select by."""
        votes = stats.window[self.window_size][layer_idx] / self.window_size  # (B, H_q, T) mean over the window
        before = self.mixed_scores(votes, keys)  # (B, H_kv, T − W)
        return F.pad(before, (0, self.window_size), value=float("inf"))  # (B, H_kv, T)

    def keep_indices(self, layer_idx, keys, values, stats, n_keep):
        votes = stats.window[self.window_size][layer_idx] / self.window_size  # (B, H_q, T)
        return self.window_keep(votes, keys, n_keep)
