"""Expected Attention (Devoto et al. 2025, https://arxiv.org/abs/2510.00636; kvpress's ExpectedAttentionPress).

Scores each cached key by the attention that *future* queries are expected to pay it. The prompt's pre-RoPE
queries (the first `n_sink` positions left out) give a per-query-head mean μ and covariance Σ; the RoPE rotation
averaged over the next `n_future_positions` positions, R̄ = mean_p R(p), carries them to the future: μ' = R̄μ,
Σ' = R̄ΣR̄ᵀ. For q ~ N(μ', Σ'), E[exp(q·k/√d)] = exp(μ'·k/√d + kᵀΣ'k/(2d)); the scores are that exponent,
softmaxed over the keys, averaged over the KV head's query group, times ‖v‖₂ (`use_vnorm`, after `+ epsilon`).
The `n_sink` first positions are always kept. The query moments come from the chunked statistics recorder
(post-RoPE queries rotated back by their positions): no eager attention, no second pass over the hidden states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, Method
from kvbench.model.attention import StatsRequest
from kvbench.model.rope import rotate_half


@METHODS.register("expected_attention")
@dataclass
class ExpectedAttention(Method):
    caps = Capabilities(needs=frozenset({"full_rope"}))  # query moments through the model's rotary embedding
    n_future_positions: int = knob(512, min=1, tokens=True)  # future query positions the RoPE rotation is averaged over
    n_sink: int = knob(4, tokens=True)  # first positions left out of the query statistics and always kept
    use_covariance: bool = True  # add the kᵀΣ'k/(2d) term (False: the mean query only)
    use_vnorm: bool = True  # rescale by the value norms
    epsilon: float = 0.0

    def __post_init__(self):
        if self.n_future_positions < 1 or self.n_sink < 0:
            raise KvbenchError(
                f"expected_attention: n_future_positions={self.n_future_positions} must be ≥ 1 and "
                f"n_sink={self.n_sink} ≥ 0"
            )

    def stats_request(self) -> StatsRequest:
        return StatsRequest(query_moments=frozenset({self.n_sink}))

    def min_tokens(self) -> int:
        return self.n_sink + 1

    def average_rotation(self, first_position: int, inv_freq: torch.Tensor, rope_scaling: float) -> torch.Tensor:
        """R̄ = mean over p in [first, first + n_future) of R(p) = diag(cos pθ) + diag(sin pθ)·P: (D, D) fp32,
        where P·x = rotate_half(x) (transformers' RoPE convention)."""
        device = inv_freq.device
        positions = torch.arange(first_position, first_position + self.n_future_positions, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # (F, D/2)
        angles = torch.cat([freqs, freqs], dim=-1)  # (F, D)
        cos = angles.cos().mean(0) * rope_scaling  # (D,)
        sin = angles.sin().mean(0) * rope_scaling  # (D,)
        rotate = rotate_half(torch.eye(len(cos), device=device)).T  # (D, D): P with P @ x = rotate_half(x)
        return torch.diag(cos) + torch.diag(sin) @ rotate  # (D, D)

    def scores(self, layer_idx, keys, values, stats):
        moments = stats.moments.get(self.n_sink, {}).get(layer_idx)
        if moments is None or moments.count == 0:
            raise KvbenchError(
                "expected_attention: the prefill recorded no query statistics (a prompt of at most "
                f"n_sink={self.n_sink} tokens, or a model whose attention does not report them)"
            )
        bsz, n_kv_heads, n_tokens, head_dim = keys.shape
        mean, cov = moments.mean_cov()  # (B, H_q, D), (B, H_q, D, D)
        rotation = self.average_rotation(n_tokens, moments.inv_freq, moments.rope_scaling)  # (D, D)
        mean = mean @ rotation.T  # (B, H_q, D): μ' = R̄μ per head
        group = mean.shape[1] // n_kv_heads
        k = keys[:, :, self.n_sink :].float()  # (B, H_kv, T', D)
        exponent = torch.einsum("bhtd,bhgd->bhgt", k, mean.view(bsz, n_kv_heads, group, head_dim)) / math.sqrt(head_dim)
        if self.use_covariance:
            cov = rotation @ cov @ rotation.T  # (B, H_q, D, D): Σ' = R̄ΣR̄ᵀ
            cov = cov.view(bsz, n_kv_heads, group, head_dim, head_dim)  # (B, H_kv, G, D, D)
            exponent += torch.einsum("bhtd,bhgde,bhte->bhgt", k, cov, k) / head_dim / 2  # (B, H_kv, G, T')
        scores = exponent.softmax(dim=-1).mean(dim=2)  # (B, H_kv, T'): expected attention, group-averaged
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values[:, :, self.n_sink :].float().norm(dim=-1)
        sinks = scores.new_full((bsz, n_kv_heads, min(self.n_sink, n_tokens)), float("inf"))  # (B, H_kv, S)
        return torch.cat([sinks, scores], dim=-1)  # (B, H_kv, T)
