"""The method interface: what every method declares, and the hooks the engine drives it through.

A method is a small dataclass whose fields are its knobs, with their defaults (conf/method/<name>.yaml repeats them
for Hydra; tests/methods/test_methods.py checks that the two agree for every registered method). Every module in
methods/ is imported by methods/__init__.py, so a new file with `@METHODS.register("name")` and its yaml are all it
takes. What a method is (family, budget, which engine paths serve it) is declared once, in `caps` (`Capabilities`
below), and read as `method.caps.<name>`: nothing is looked up on a method by name. Every hook but `scores` has a
working default, so a method overrides only what it changes:

scoring and selection (pure: the same arguments give the same answer, nothing is kept on the method)
- `bind(lm)`                          see the loaded model (RoPE frequencies for position re-indexing)
- `stats_request()`                   attention statistics the prefill must record (observation window, all queries)
- `scores(l, K, V, stats)`            per KV head and position, (B, H_kv, T); +inf: always kept. A method defining
                                      it is a scorer (`scorer_names()`), which adakv and decoding can wrap
- `keep_indices(l, K, V, stats, n)`   per layer and KV head, which prompt positions to keep (default: top scores)
byte accounting (the rules compression follows and the planner predicts bytes with, kvbench.model.kv_bytes)
- `min_tokens()`                      the fewest kept tokens the method works with (its sinks/windows)
- `layer_tokens(n_keep, L, T)`        tokens kept per layer (uniform; PyramidKV redistributes them)
- `layer_keep_counts(T, L, budget)`   prompt tokens each layer keeps
- `held_after_decoding(kept, ...)`    tokens each layer holds after appending and decoding (grows by default)
one example's compression
- `begin(T, L, budget)`               a `Compression` (methods/compression.py): what this example's compression
                                      keeps (counts, kept positions per layer, decode-time state), built layer by
                                      layer by its `layer` and `end` — after a shared prefill (`run`), or inside
                                      the forward pass with prefill=inline (kvbench/native/inline.py) — and driven
                                      while decoding by its hooks. Methods that keep state return a subclass
- `compress(prefill_kv, stats, budget)`  `begin` and `run` in one call: the cache alone
recording
- `params()`                          the knobs as recorded in the `method_params` column
- `lossless_params(lm)`               knobs under which the method must reproduce the full cache exactly (tested)

Modes, each a mixin or a wrapper with its own contract, never an attribute probed for:
- decode time: a `Compression` subclass (statistics per decode step, evicting after it, RoPE positions):
  methods/decode_eviction.py's `Evicting` implements it once for H2O, StreamingLLM, TOVA and R-KV;
  methods/decoding.py re-selects by any scorer while generating
- model conversion: methods/modes.py's `ChangesModel` (head merging; declared `caps.shares_prefill=False`)
- head-wise budgets: methods/adakv.py, and decoding, wrap a scorer (methods/scorers.py's `WrapsScorer`)
- composition: methods/compose.py stacks one method per family (`caps.family`)
- prefill=inline / prefill_chunk: the compress path, per layer (kvbench.native.inline), as `caps.compresses_inline`
  and `caps.chunk_limit` allow; streaming (task=ppl): kvbench.native.streaming's `Stream` re-compresses after each
  chunk (DecodeEviction evicts like a decode step instead), as `caps.stream_limit` allows
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench import KvbenchError
from kvbench.config.registry import Registry, build_dataclass
from kvbench.config.rules import check_fields
from kvbench.methods.compression import Compression
from kvbench.model.attention import StatsRecorder, StatsRequest
from kvbench.model.cache import KV

METHODS = Registry("method")


@dataclass(frozen=True)
class Budget:
    """Prompt KV tokens kept per layer: a fraction in (0, 1] of the prompt, or an absolute count (> 1, integer)."""

    value: float

    @classmethod
    def parse(cls, value) -> Budget:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise KvbenchError(
                f"budget={value!r} is not a number; give a fraction in (0, 1] or a token count"
            ) from None
        if not number > 0 or math.isinf(number):
            raise KvbenchError(f"budget={value} must be > 0: a fraction in (0, 1] (1.0 = no eviction) or a token count")
        if number > 1 and not number.is_integer():
            raise KvbenchError(
                f"budget={value}: a fraction must be in (0, 1]; "
                "a budget above 1 is a token count and must be an integer"
            )
        return cls(number)

    @property
    def is_tokens(self) -> bool:
        return self.value > 1

    def tokens(self, prompt_tokens: int) -> int:
        """Tokens to keep out of `prompt_tokens` (never more than the prompt)."""
        if self.is_tokens:
            return min(int(self.value), prompt_tokens)
        return min(prompt_tokens, max(1, round(self.value * prompt_tokens)))


@dataclass(frozen=True)
class Capabilities:
    """What a method is and which engine paths serve it. Declared once per class (`caps = Capabilities(...)`); a
    method whose knobs decide one sets its own in __post_init__ (`self.caps = dataclasses.replace(self.caps, ...)`)."""

    family: str = "eviction"  # eviction | precision | structure | none | composite: what `compose` stacks
    has_budget: bool = True  # False: the method keeps every token (quantization, head merging, full)
    shares_prefill: bool = True  # False: the method changes the model (head merging): a prefill of its own
    layers_can_select: bool = True  # precision methods: whether its cache layers support token eviction
    compresses_inline: bool = True  # False: selection needs every layer's K/V first (kvzip): no prefill=inline
    chunk_limit: str = ""  # why prefill_chunk cannot re-compress the cache after each chunk ("": it can)
    stream_limit: str = ""  # what to run instead, where task=ppl cannot stream the method ("": it can)
    evicts_while_decoding: bool = False  # on_decode_step drops tokens (compose checks its precision part allows it)
    decodes_alone: bool = False  # decoding needs Engine.decode's own loop (StreamingLLM's ring layers): no grid row
    extends_token_by_token: bool = False  # appended tokens are decode steps, one forward each (decoding)
    reindexes_positions: bool = False  # RoPE positions counted inside the cache (StreamingLLM positions=rolling)
    # what the method reads of the model beyond its cache (kvbench/preflight/support.py refuses the models lacking it):
    # "full_rope" one rotary embedding over the whole head; "qkv_projections" separate q/k/v projections under
    # model.model.layers; "per_head_qk_norm", "full_rope_width" (kvzip's own query path); "full_attention_layers"
    # no sliding-window layers; "kvbench_attention" the model's attention calls kvbench's attention function
    needs: frozenset = frozenset()


@dataclass
class Method:
    name: ClassVar[str]  # set by METHODS.register
    caps = Capabilities()  # what the method is (not a knob: no annotation, so not a dataclass field)

    # ---- scoring and selection -----------------------------------------------------------------------------
    def bind(self, lm) -> None:
        """Called with the LoadedModel before compressing (methods needing e.g. RoPE frequencies keep them)."""

    def stats_request(self) -> StatsRequest:
        return StatsRequest()

    def scores(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, stats) -> torch.Tensor:
        """Per-head scores (B, H_kv, T) fp32 of a layer's keys/values (B, H_kv, T, D) as cached (post-RoPE keys);
        +inf marks positions the method always keeps (sinks, observation windows)."""
        raise KvbenchError(f"{self.name} has no per-head scores; use a scorer: {', '.join(scorer_names())}")

    def keep_indices(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, stats: StatsRecorder, n_keep: int
    ) -> torch.Tensor:
        """Positions to keep for one layer of keys/values (B, H_kv, T, D): (B, H_kv, n_keep) int64, sorted
        ascending; each KV head's `n_keep` highest `scores` unless the method selects otherwise."""
        return top_k_sorted(self.scores(layer_idx, keys, values, stats), n_keep)  # (B, H_kv, n_keep)

    # ---- byte accounting -----------------------------------------------------------------------------------
    def min_tokens(self) -> int:
        """The smallest number of kept tokens the method can work with (sinks, windows)."""
        return 1

    def layer_tokens(self, n_keep: int, n_layers: int, n_prompt: int) -> list[int]:
        """Tokens kept in each layer; uniform by default (PyramidKV redistributes the same total)."""
        return [n_keep] * n_layers

    def layer_keep_counts(self, n_prompt: int, n_layers: int, budget: Budget | None) -> list[int] | None:
        """Prompt tokens each layer keeps under `budget`; None when nothing is evicted. The one rule both
        `compress` and the planner's byte accounting (kvbench.model.kv_bytes) follow."""
        if budget is None or not self.caps.has_budget:
            return None
        n_keep = budget.tokens(n_prompt)
        if n_keep >= n_prompt:
            return None
        if n_keep < self.min_tokens() and not budget.is_tokens:
            # a fraction of a short prompt: keep the method's minimum (its window/sinks) instead, as SnapKV
            # compresses only prompts longer than its capacity; the measured kv_ratio records what was kept
            n_keep = self.min_tokens()
            if n_keep >= n_prompt:
                return None
        if n_keep < self.min_tokens():
            raise KvbenchError(
                f"budget {budget.value} keeps {n_keep} of {n_prompt} prompt tokens, fewer than {self.name} needs "
                f"({self.min_tokens()}: its sinks/windows); raise the budget or shrink the window"
            )
        return [min(n, n_prompt) for n in self.layer_tokens(n_keep, n_layers, n_prompt)]

    def held_after_decoding(
        self, kept: list[int], n_prompt: int, budget: Budget | None, appended: int, decoded: int
    ) -> tuple[list[int], bool]:
        """Tokens each layer holds after `appended` uncompressed tokens and `decoded` decode steps, from the `kept`
        per layer of an n_prompt-token prompt compressed at `budget`; and whether decode-time eviction holds the
        layers at a size. The cache just grows unless the method evicts while decoding (methods/decode_eviction.py,
        methods/decoding.py): the rule the planner's byte accounting (kvbench.model.kv_bytes) follows."""
        return [n + appended + decoded for n in kept], False

    # ---- the compress path ---------------------------------------------------------------------------------
    def begin(self, n_prompt: int, n_layers: int, budget: Budget | None) -> Compression:
        """One example's compression of an n_prompt-token prompt (methods/compression.py): the object that holds
        what it keeps; its `layer` and `end` build the cache. A method whose selection or decoding keeps state
        returns a subclass of its own."""
        return Compression(self, n_prompt, n_layers, budget)

    def compress(self, prefill_kv: list[KV], stats: StatsRecorder, budget: Budget | None):
        """The cache to decode from, after the whole prefill, in one call (`begin` then its `run`); the engine
        keeps the compression itself, for its decode-time hooks and kept positions."""
        return self.begin(prefill_kv[0][0].shape[2], len(prefill_kv), budget).run(prefill_kv, stats)

    # ---- recording -----------------------------------------------------------------------------------------
    @classmethod
    def lossless_params(cls, lm) -> dict | None:
        """Parameters under which the method must reproduce the full cache exactly (tested for every method);
        None for a method that has no lossless setting."""
        return {}

    def params(self) -> dict:
        """The knobs as recorded in the `method_params` column."""
        return dataclasses.asdict(self)


def scorer_names() -> list[str]:
    """The registered methods that define per-head `scores` (what adakv and decoding can wrap): no list to keep."""
    return [name for name in METHODS.names() if METHODS.get(name).scores is not Method.scores]


def top_k_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores along the last axis, in ascending position order."""
    n = scores.shape[-1]
    if k == n - 1 > 0:  # one token dropped (per-step eviction): every position but the lowest, when it is unique
        lowest = scores.argmin(dim=-1, keepdim=True)  # (..., 1)
        if bool(((scores == scores.gather(-1, lowest)).sum(-1) == 1).all()):  # else (ties, NaN) topk decides
            positions = torch.arange(n - 1, device=scores.device)  # (n - 1,)
            return positions + (positions >= lowest).long()  # (..., n - 1): the lowest skipped
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def check_choice(name: str, value, choices) -> None:
    """A knob that takes one of `choices`: one line naming them otherwise."""
    if value not in choices:
        raise KvbenchError(f"{name}={value!r}: use one of {', '.join(map(str, choices))}")


def method_defaults(name: str) -> dict:
    """A registered method's knobs and their defaults (its dataclass fields), for methods built by name (grids,
    compose); conf/method/<name>.yaml repeats them for Hydra (a test checks they agree)."""
    defaults = {}
    for knob in dataclasses.fields(METHODS.get(name)):
        if knob.init and knob.default is not dataclasses.MISSING:
            defaults[knob.name] = copy.deepcopy(knob.default)
        elif knob.init and knob.default_factory is not dataclasses.MISSING:
            defaults[knob.name] = knob.default_factory()
    return defaults


def build_method(name: str, params: dict | None = None, where: str = "method") -> Method:
    """Instantiate a registered method from its config (unknown names and parameters list the valid ones), each
    knob checked by its field's rule first (kvbench.config.rules.check_fields) wherever it was given: `where` names
    it for the user (`method`, `adakv.scorer_params`, `compose.overrides.kivi`)."""
    cls = METHODS.get(name)
    params = dict(params or {})
    check_fields(where, cls, params)
    return build_dataclass(cls, params, f"method {name!r}" if where == "method" else where)
