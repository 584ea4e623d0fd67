"""Compression during long generations (kvpress's DecodingPress), for any scoring method.

The prompt is compressed by the `scorer` method at the run's `budget` as usual (1.0: not at all); then, while
generating, every `compress_every` steps each layer holding more than `decode_budget` tokens is re-selected down
to `decode_budget` by the scorer's per-head scores over everything cached (prompt and generated tokens), so the
cache oscillates between `decode_budget` and `decode_budget + compress_every` tokens per layer.

Decode-time statistics: each step's forward records the scorer's statistics for its single query; the rows of the
steps since the last compression stand in for an observation window (summed over the last W of them, as SnapKV's
window of W queries; TOVA's W = 1 is the last query), and their pre-RoPE query moments for Expected Attention's
(kvpress buffers the decode hidden states for the same purpose). Both are cleared after each compression.
Tokens appended after prefill (a forced trace, the question when query_aware=false) go through the same per-token
path as generated ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, scorer_names, top_k_sorted
from kvbench.methods.compression import Compression
from kvbench.methods.scorers import WrapsScorer
from kvbench.model.attention import QueryMoments, StatsRecorder, StatsRequest
from kvbench.model.cache import held_kv, layer_select


class Redecoding(Compression):
    """One example's decoding compression: the scorer's own compression of the prompt, then the decode steps'
    statistics since the last re-selection."""

    acts_while_decoding = True
    method: Decoding

    def __init__(self, method: Decoding, n_prompt: int, n_layers: int, budget):
        super().__init__(method, n_prompt, n_layers, budget)
        # the scorer's own compression selects the prompt; its decode-time hooks (TOVA's eviction) are never called:
        # this one decides when
        self.prompt = method._scorer.begin(n_prompt, n_layers, budget)
        self.kept = self.prompt.kept  # what the scorer's compression keeps
        self.armed = False
        self.steps = 0
        self.rows: dict[int, dict[int, list[torch.Tensor]]] = {}  # W → layer → recent (B, H_q, T_step) rows
        self.moments: dict[int, dict[int, QueryMoments]] = {}  # n_sink → layer → moments since last compression

    # ---- prefill: the scorer's own compression (bind, stats, token counts: WrapsScorer) -----------------------
    def layer(self, layer_idx, keys, values, stats):
        return self.prompt.layer(layer_idx, keys, values, stats)

    def end(self, layers, stats):
        cache = self.prompt.end(layers, stats)
        self.armed = True
        return cache

    # ---- decode ----------------------------------------------------------------------------------------------
    def decode_request(self) -> StatsRequest:
        return self.method._scorer.stats_request() if self.armed else StatsRequest()

    def on_decode_step(self, cache, stats) -> None:
        if not self.armed:
            return
        self.remember(stats)
        self.steps += 1
        if self.steps < self.method.compress_every:
            return
        window = self.window_stats(cache)
        decode_budget, scorer = self.method.decode_budget, self.method._scorer
        for layer_idx, layer in enumerate(cache.layers):
            if isinstance(layer, DynamicSlidingWindowLayer):
                continue  # a sliding layer keeps its window (kvbench.model.cache.WindowLayer)
            keys, values = held_kv(layer)  # (B, H_kv, T, D): a prefix-cache layer's shared part too
            if keys.shape[2] > decode_budget:
                scores = scorer.scores(layer_idx, keys, values, window)  # (B, H_kv, T)
                layer_select(layer, top_k_sorted(scores, decode_budget))
        self.steps, self.rows, self.moments = 0, {}, {}

    def remember(self, stats: StatsRecorder) -> None:
        for w, layers in stats.window.items():
            for layer_idx, row in layers.items():  # (B, H_q, T_step): one query's attention
                rows = self.rows.setdefault(w, {}).setdefault(layer_idx, [])
                rows.append(row)
                del rows[:-w]  # only the last W queries vote
        for skip, layer_moments in stats.moments.items():
            for layer_idx, step in layer_moments.items():
                bsz, n_heads, head_dim = step.total.shape  # (B, H_q, D)
                total = self.moments.setdefault(skip, {}).setdefault(
                    layer_idx, QueryMoments.empty(bsz, n_heads, head_dim, step.inv_freq, step.rope_scaling)
                )
                total.count, total.total, total.outer = (
                    total.count + step.count,
                    total.total + step.total,
                    total.outer + step.outer,
                )

    def window_stats(self, cache) -> StatsRecorder:
        """The recent steps' statistics in the shape the scorer reads after prefill."""
        recorder = StatsRecorder(self.method._scorer.stats_request())
        for w, layers in self.rows.items():
            for layer_idx, rows in layers.items():
                n_tokens = cache.layers[layer_idx].get_seq_length()
                padded = [torch.nn.functional.pad(row, (0, n_tokens - row.shape[-1])) for row in rows]  # later keys: 0
                recorder.window.setdefault(w, {})[layer_idx] = torch.stack(padded).sum(0)  # (B, H_q, T)
        recorder.moments = self.moments
        return recorder


@METHODS.register("decoding")
@dataclass
class Decoding(WrapsScorer):
    scorer: str = "knorm"  # the method whose scores select (built from its conf/method/<scorer>.yaml)
    compress_every: int = knob(64, min=1, tokens=True)  # generated tokens between two compressions
    decode_budget: int = knob(256, min=1, tokens=True)  # tokens per layer kept by each decode-time compression
    scorer_params: dict = field(default_factory=dict)  # the scorer's knobs over its defaults

    # appended tokens are decode steps (engine._extend)
    caps = Capabilities(evicts_while_decoding=True, extends_token_by_token=True)

    def __post_init__(self):
        self.wrap(self.scorer, self.scorer_params)
        if self.compress_every < 1 or self.decode_budget < 1:
            raise KvbenchError(
                f"decoding: compress_every={self.compress_every} and decode_budget={self.decode_budget} must be ≥ 1"
            )
        # re-scoring a grown cache from later queries' statistics is what re-compressing after a prefill chunk needs
        if self._scorer.caps.chunk_limit:
            usable = sorted(name for name in scorer_names() if not METHODS.get(name).caps.chunk_limit)
            raise KvbenchError(
                f"decoding: scorer={self.scorer} cannot re-score while decoding ({self._scorer.caps.chunk_limit}); "
                f"use one of {', '.join(usable)}"
            )

    def begin(self, n_prompt, n_layers, budget) -> Redecoding:
        return Redecoding(self, n_prompt, n_layers, budget)

    def held_after_decoding(self, kept, n_prompt, budget, appended, decoded):
        """Every compress_every steps (appended tokens are steps too) a layer above decode_budget drops to it."""
        out = []
        for size in kept:
            for step in range(1, appended + decoded + 1):
                size += 1
                if step % self.compress_every == 0 and size > self.decode_budget:
                    size = self.decode_budget
            out.append(size)
        return out, False

    @classmethod
    def lossless_params(cls, lm) -> dict | None:
        return {"decode_budget": lm.max_context}  # every token the model reads: nothing is ever evicted
