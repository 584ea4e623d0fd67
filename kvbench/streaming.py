"""Perplexity of a long text streamed through a bounded cache (StreamingLLM's long-text evaluation).

The text is fed in chunks of `chunk` tokens. After each chunk the method bounds the cache (`stream_bound`):
eviction methods keep their budget of tokens, quantization compresses once; so memory stays bounded while the
text grows and the per-window perplexity shows what the bound costs. The full cache is the reference.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench import KvbenchError
from kvbench.attention import recording
from kvbench.cache import cache_nbytes, full_cache_nbytes, layer_lengths
from kvbench.engine import Engine
from kvbench.memory import read_peak, reset_peak, synchronize
from kvbench.methods import Budget, Method


@dataclass
class Window:
    index: int
    tokens_seen: int  # text tokens fed so far (end of this window)
    n_predicted: int  # next-token predictions scored in this window
    nll_sum: float
    cache_tokens: int  # tokens held per layer after bounding (layer 0)
    kv_bytes: int
    kv_bytes_full: int
    seconds: float
    peak_mem_bytes: int
    peak_mem_delta_bytes: int  # over the memory in use when the window started (the model and the bounded cache)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.n_predicted) if self.n_predicted else float("nan")


def stream_budget(budget: Budget | None, n_tokens: int) -> Budget | None:
    """A streamed text's cache bound in tokens: a fraction is of the whole text (0.25 of 4096 → 1024 tokens)."""
    return Budget.parse(max(2, budget.tokens(n_tokens))) if budget else None


@torch.inference_mode()
def stream_perplexity(
    engine: Engine, method: Method, budget: Budget | None, ids: list[int], chunk: int
) -> list[Window]:
    """Per-window next-token NLL of `ids`, feeding `chunk` tokens at a time through a bounded cache."""
    from transformers import DynamicCache

    lm, device = engine.lm, engine.lm.device
    method.bind(lm)
    request = method.stats_request() | method.decode_request()
    cache, windows = DynamicCache(), []
    targets = torch.tensor(ids, device=device)
    for index, start in enumerate(range(0, len(ids) - 1, chunk)):
        piece = ids[start : start + chunk]
        baseline = reset_peak(device)
        t0 = time.perf_counter()
        base = method.position(start, cache) if index else 0
        with recording(request) as stats:
            logits = engine.forward(piece, [base + i for i in range(len(piece))], cache, all_logits=True)
        cache = method.stream_bound(cache, stats, budget, first=index == 0)
        if len(set(layer_lengths(cache))) > 1:
            raise KvbenchError(
                f"{method.name} keeps a different number of tokens per layer; streaming feeds "
                "chunks through one causal mask, so use a method with uniform layers (e.g. snapkv)"
            )
        synchronize(device)
        seconds = time.perf_counter() - t0
        peak = read_peak(device)
        # position i predicts token i + 1; the text's last token has no target
        n = min(len(piece), len(ids) - 1 - start)
        nll = F.cross_entropy(logits[:n], targets[start + 1 : start + 1 + n], reduction="sum")
        end = start + len(piece)
        windows.append(
            Window(
                index,
                end,
                n,
                float(nll),
                layer_lengths(cache)[0],
                cache_nbytes(cache),
                full_cache_nbytes(lm.n_layers, engine.full_kv_heads, lm.head_dim, end, lm.dtype),
                seconds,
                peak,
                peak - baseline,
            )
        )
    return windows
