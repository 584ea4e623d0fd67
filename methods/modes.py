"""What a method adds to compressing a prompt, each declared by inheriting a mixin (never probed for by name):

- `DecodeTime`: the method acts while generating (methods/decode_eviction.py's DecodeEviction: H2O, StreamingLLM,
  TOVA; methods/decoding.py; compose, for its eviction part). The engine calls its hooks around every decode
  forward, reaching any method's through `decode_time(method)`: a method that is no DecodeTime gets `STEADY`'s
  (no statistics, absolute positions, nothing evicted).
- `HooksPrefill`: the method compresses with hooks of its own inside the prompt's forward (kvpress's presses,
  methods/kvpress.py): Engine.hooked_generate runs the prefill inside `hooked_prefill` and decodes inside
  `hooked_decode`; the cache the hooks leave is the one decoding starts from (no `compress`).
- `ChangesModel`: the method converts the model itself (head merging; compose, for its structure part) and so
  declares `caps.shares_prefill=False`: Engine.prepared runs its prefill on the converted model.
"""

from __future__ import annotations

import abc

from kvbench.model.attention import StatsRecorder, StatsRequest


class DecodeTime:
    """Mixin: hooks the engine calls while decoding (Engine.decode, batched examples, grid rows, diagnose)."""

    def decode_request(self) -> StatsRequest:
        """Statistics each decode forward must record."""
        return StatsRequest()

    def on_extend(self, n_tokens: int) -> None:
        """`n_tokens` are about to be appended uncompressed (the question when query_aware=false): methods that
        evict while decoding grow their size by that much instead of evicting the context for them."""

    def on_decode_start(self, cache, position: int) -> None:
        """Decoding one token per step starts from `cache` (the next token at `position`): Engine.decode and
        batched examples (kvbench.engine.batched) call it; grid batches and diagnose do not."""

    def on_decode_step(self, cache, stats: StatsRecorder) -> None:
        """Called after each decode forward (the new token is already in the cache): evict to stay at the budget."""

    def position(self, absolute_position: int, cache) -> int:
        """RoPE position for the next token; the original absolute position unless the method re-indexes
        (StreamingLLM positions=rolling). Chunked prefill and streaming place each chunk by it too."""
        return absolute_position

    def slack(self) -> int:
        """Tokens a layer may hold beyond its size between two evictions (block eviction: evict_every − 1); the
        engine's in-place slot buffers (kvbench.engine.slots) leave room for them."""
        return 0


STEADY = DecodeTime()  # the decode-time hooks of a method that does nothing while generating


def decode_time(method) -> DecodeTime:
    """`method`'s decode-time hooks: its own when it is a DecodeTime, else STEADY's."""
    return method if isinstance(method, DecodeTime) else STEADY


class ChangesModel:
    """Mixin: a method that converts the model before the prefill (head merging)."""

    def prepare_model(self, model):
        """The model to prefill and decode with (`model` itself when there is nothing to convert)."""
        return model


class HooksPrefill(abc.ABC):
    """Mixin: the method's own hooks on the model compress the cache during the prompt's forward pass. A subclass
    supplies both context managers (an abstract class cannot be built without them)."""

    @abc.abstractmethod
    def hooked_prefill(self, lm, n_prompt: int, budget):
        """A context manager around the prompt's forward (`n_prompt` tokens, the run's budget)."""

    @abc.abstractmethod
    def hooked_decode(self, lm):
        """A context manager around appending the suffix and decoding; on exit the model is as before."""

    def kv_ratio_nominal(self, context_tokens: int, decoded: int) -> float | None:
        """The cache the method claims after the last prefill, as a share of the full cache at
        `context_tokens + decoded` tokens (the row's `kv_ratio_nominal`); None where it claims none."""
        return None
