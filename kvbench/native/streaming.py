"""Perplexity of a long text streamed through a bounded cache (StreamingLLM's long-text evaluation).

The text is fed in chunks of `chunk` tokens. After each chunk a `Stream` bounds the cache with the method's
compress path (`Stream.bound`): eviction methods keep their budget of tokens, quantization compresses once; so
memory stays bounded while the text grows and the per-window perplexity shows what the bound costs. The full
cache is the reference.

`prefill=inline` bounds each layer right after its attention inside the chunk's forward instead (`Stream.begin`,
`Stream.layer` from the per-layer hook of kvbench.native.inline, `Stream.end` — the calls `Stream.bound` makes after
the forward): the same entries and the same per-token NLL, while at most one layer holds its unbounded chunk K/V
and one layer's statistics exist at a time (tests/native/test_ppl_inline.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvbench import KvbenchError
from kvbench.methods import Budget, Method
from kvbench.methods.compression import Compression
from kvbench.methods.decode_eviction import DecodeEviction, Evicting
from kvbench.model.attention import recording
from kvbench.model.cache import cache_nbytes, layer_lengths
from kvbench.native.engine import Engine
from kvbench.native.inline import forward_per_layer
from kvbench.native.memory import read_peak, reset_peak, synchronize

LOGITS = {"all_logits": True, "fp32": False}  # every position's, in the model's dtype (upcast in _token_nll)


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
    kv_bytes_full_dense: int = 0  # every token in every layer (sliding layers as if global)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.n_predicted) if self.n_predicted else float("nan")


def stream_budget(budget: Budget | None, n_tokens: int) -> Budget | None:
    """A streamed text's cache bound in tokens: a fraction is of the whole text (0.25 of 4096 → 1024 tokens)."""
    return Budget.parse(max(2, budget.tokens(n_tokens))) if budget else None


def stream_perplexity(
    engine: Engine, method: Method, budget: Budget | None, ids: list[int], chunk: int, inline: bool = False
) -> list[Window]:
    """Per-window next-token NLL of `ids`, feeding `chunk` tokens at a time through a bounded cache; `inline`:
    each layer bounded inside the forward right after its attention, else every layer after the forward."""
    return [window for window, _, _ in stream_chunks(engine, method, budget, ids, chunk, inline)]


@torch.inference_mode()
def stream_chunks(
    engine: Engine, method: Method, budget: Budget | None, ids: list[int], chunk: int, inline: bool = False
) -> Iterator[tuple[Window, torch.Tensor, DynamicCache]]:
    """Per chunk: its Window, the per-token NLL (n,) fp32 of the predictions it scores, and the bounded cache."""
    lm, device = engine.lm, engine.lm.device
    method.bind(lm)
    request = method.stats_request()  # what compressing a chunk and evicting like a decode step both read
    stream = Stream(method, budget)
    cache = DynamicCache()
    targets = torch.tensor(ids, device=device)
    for index, start in enumerate(range(0, len(ids) - 1, chunk)):
        piece = ids[start : start + chunk]
        baseline = reset_peak(device)
        t0 = time.perf_counter()
        base = stream.position(start, cache) if index else 0
        positions = [base + i for i in range(len(piece))]
        first = index == 0
        if inline:  # each layer bounded right after its attention: one layer's chunk K/V and statistics at a time
            stream.begin(cache.get_seq_length() + len(piece), lm.n_layers, first)
            bound = _streamer(stream, cache)
            logits, stats = forward_per_layer(engine, cache, request, piece, positions, bound, **LOGITS)
            cache = stream.end(cache, stats)
        else:  # every layer holds its chunk K/V, and its statistics, until the forward ends
            with recording(request) as stats:
                logits = engine.forward(piece, positions, cache, **LOGITS)  # (chunk, V)
            cache = stream.bound(cache, stats, first)
        del stats  # not needed by the next chunk's forward
        if len(set(layer_lengths(cache))) > 1:
            raise KvbenchError(
                f"{method.name} keeps a different number of tokens per layer; streaming feeds "
                "chunks through one causal mask, so use a method with uniform layers (e.g. snapkv)"
            )
        synchronize(device)
        seconds = time.perf_counter() - t0
        peak = read_peak(device)  # the chunk's forward and bounding (its logits included), not the scoring below
        # position i predicts token i + 1; the text's last token has no target
        n = min(len(piece), len(ids) - 1 - start)
        token_nll = _token_nll(logits[:n], targets[start + 1 : start + 1 + n])  # (n,)
        del logits  # freed before the next chunk's forward rather than after it
        end = start + len(piece)
        window = Window(
            index,
            end,
            n,
            float(token_nll.sum()),
            layer_lengths(cache)[0],
            cache_nbytes(cache),
            engine.full_layout.full_bytes(end),
            seconds,
            peak,
            peak - baseline,
            engine.full_layout.dense_bytes(end),
        )
        yield window, token_nll, cache


def _token_nll(logits: torch.Tensor, targets: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """Next-token NLL (n,) fp32 of logits (n, V) in the model's dtype, upcast `rows` at a time: a 1K-token chunk's
    logits in fp32 would be 192 MiB at a 49K vocabulary, more than a bounded cache (each row is the same fp32
    log-softmax as the whole tensor's)."""
    return torch.cat(
        [
            F.cross_entropy(logits[i : i + rows].float(), targets[i : i + rows], reduction="none")  # (rows,)
            for i in range(0, logits.shape[0], rows)
        ]
    )


class Stream:
    """A method bounding a streamed text's cache after each chunk, through its compress path.

    Eviction methods re-select from what each layer holds (with this chunk's statistics): a fresh compression to
    the budget; methods without a budget compress once, after the first chunk (quantization), and then let the
    cache grow; decode-time evictors that say so (`DecodeEviction.stream_evicts`: H2O, StreamingLLM) compress the
    first chunk and then evict like a decode step. A method that declares `caps.stream_limit` is refused."""

    def __init__(self, method: Method, budget: Budget | None):
        self.method, self.budget = method, budget
        self.compression: Compression | None = None  # the last chunk's compression (evicting: the first chunk's)
        self._evicting: Evicting | None = None  # after the first chunk: the decode-time evictor
        self._compresses = False

    def position(self, absolute_position: int, cache) -> int:
        """Where the next chunk goes: the last compression's `position` (rolling positions count in the cache)."""
        return absolute_position if self.compression is None else self.compression.position(absolute_position, cache)

    def begin(self, n_tokens: int, n_layers: int, first: bool) -> None:
        """Before a chunk's layers are bounded; n_tokens: what each layer holds, the chunk included."""
        method = self.method
        if method.caps.stream_limit:
            raise KvbenchError(
                f"{method.name} is not supported by the streaming perplexity task (task=ppl); "
                + method.caps.stream_limit
            )
        held = self.compression
        evicts = isinstance(method, DecodeEviction) and method.stream_evicts and not first
        self._evicting = held if evicts and isinstance(held, Evicting) else None
        self._compresses = self._evicting is None and (first or method.caps.has_budget)
        if self._compresses:
            self.compression = method.begin(n_tokens, n_layers, self.budget if method.caps.has_budget else None)

    def layer(self, layer_idx: int, layer, stats):
        """One layer right after this chunk's attention (it holds what it kept + the chunk): the layer to keep."""
        if self._evicting is not None:
            self._evicting.evict_streamed_layer(layer_idx, layer, stats)
            return layer
        if not self._compresses:
            return layer
        assert self.compression is not None  # begun by `begin`
        return self.compression.layer(layer_idx, layer.keys, layer.values, stats)

    def end(self, cache, stats):
        """After every layer of a chunk is bounded: the cache to continue with."""
        if not self._compresses:
            return cache
        assert self.compression is not None  # begun by `begin`
        return self.compression.end(list(cache.layers), stats)

    def bound(self, cache, stats, first: bool):
        """After a whole chunk's forward: `begin`, `layer` per layer, `end` — the calls prefill=inline makes one
        layer at a time inside the forward, so both bound every layer identically."""
        self.begin(cache.layers[0].get_seq_length(), len(cache.layers), first)
        cache.layers[:] = [self.layer(i, layer, stats) for i, layer in enumerate(cache.layers)]
        return self.end(cache, stats)


def _streamer(stream: Stream, cache):
    """The per-layer `bound` of kvbench.native.inline.forward_per_layer for a streamed chunk: the stream's layer."""

    def bound(layer_idx, keys, values, stats):
        return stream.layer(layer_idx, cache.layers[layer_idx], stats)

    return bound
