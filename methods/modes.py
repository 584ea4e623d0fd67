"""What a method adds to compressing a prompt, each declared by inheriting a mixin (never probed for by name).
(Acting while generating is no mixin: it is the per-example `Compression` a method's `begin` returns,
methods/compression.py.)

- `HooksPrefill`: the method compresses with hooks of its own inside the prompt's forward (kvpress's presses,
  methods/kvpress.py): Engine.hooked_generate runs the prefill inside `hooked_prefill` and decodes inside
  `hooked_decode`; the cache the hooks leave is the one decoding starts from (no `compress`).
- `ChangesModel`: the method converts the model itself (head merging; compose, for its structure part) and so
  declares `caps.shares_prefill=False`: Engine.prepared runs its prefill on the converted model.
"""

from __future__ import annotations

import abc


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
