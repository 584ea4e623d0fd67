"""Prefill once, compress, decode greedily; measure time, cache bytes and peak memory.

A prefill's K/V and statistics do not depend on the compression method (each layer's prefill attention sees its
full K/V), so one `Prefill` can serve many (method, budget) configurations: `generate` never modifies it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvbench import KvbenchError
from kvbench.kernels.backend import backend
from kvbench.methods import Budget, Method
from kvbench.methods.compression import Compression
from kvbench.methods.modes import ChangesModel, HooksPrefill
from kvbench.model.attention import PromptSource, StatsRecorder, StatsRequest, recording
from kvbench.model.cache import (
    KV,
    attach_states,
    cache_kv,
    cache_nbytes,
    keep_windows,
    new_cache,
    one_mask,
    state_layers,
)
from kvbench.model.load import LoadedModel
from kvbench.native.bandwidth import weight_bytes
from kvbench.native.graph_decode import GraphStep
from kvbench.native.graph_decode import applies as graph_applies
from kvbench.native.memory import read_peak, reset_peak, synchronize
from kvbench.native.slots import plain_layers, use_slots

KEEP_LOGITS_BYTES = 64 * 2**20  # a row's kept distributions (fidelity) at most: 341 steps of a 49K vocabulary


@dataclass
class Prefill:
    kv: list[KV]  # per layer (B, H_kv, T, D), the whole prompt
    stats: StatsRecorder
    last_logits: torch.Tensor  # (V,) at the last prompt token
    seconds: float
    peak_mem_bytes: int
    # prefix caching (kvbench.run.requests): called with each configuration's compressed cache before decoding
    adopt: Callable | None = None
    baseline_bytes: int = 0  # memory in use when the prefill started (kvbench.native.memory): deltas are over it
    # prefill=inline (kvbench.native.inline): the cache was compressed inside the forward pass; `kv` is then empty
    compressed: object | None = None
    prompt_tokens: int = 0
    # the compression that made `compressed` (its decode-time state and kept positions); None: nothing to carry on
    # (a hooked prefill's cache decodes as it is)
    compression: Compression | None = None
    # a hybrid model's state layers after the prompt, by decoder layer (kvbench.model.cache.state_layers): each
    # configuration decodes from copies of them
    states: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else self.prompt_tokens

    def seconds_for(self, method: Method) -> float:
        """Prefill time charged to `method`: a shared prefill recorded every method's statistics, this one pays
        only for its own."""
        others = sum(self.stats.seconds.values()) - self.stats.seconds_for(method.stats_request())
        return self.seconds - others


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    context_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    kv_bytes: int
    kv_bytes_full: int  # the original model's uncompressed cache at the same token count
    kv_bytes_mha: int  # the same with one KV head per query head (what GQA/MQA already saved)
    peak_mem_bytes: int
    logits: list[torch.Tensor] = field(default_factory=list)
    peak_mem_delta_bytes: int | None = None  # peak over the memory in use before the prefill (None: not measured)
    kv_bytes_full_dense: int = 0  # every token in every layer (sliding layers as if global)

    @property
    def decode_ms_per_token(self) -> float:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.kv_bytes_full


@dataclass
class Compressed:
    """A configuration's compressed cache (suffix appended) and where decoding starts (Engine.compressed)."""

    cache: Any  # a transformers Cache; None once a grid batch has copied it
    logits: torch.Tensor  # (V,) for the first generated token
    position: int  # absolute position of the next token
    prompt_tokens: int
    suffix_tokens: int
    prefill_s: float  # the prefill's share charged to this method + compression + suffix
    prefill_peak: int  # peak memory of the prefill and of this compression
    baseline_bytes: int = 0  # memory in use when the prefill started (peak_mem_delta_bytes is over it)
    start_bytes: int = 0  # memory in use when this compression started (after reset_peak's trim)
    # this configuration's compression of this example: decoding runs its hooks (methods/compression.py)
    compression: Compression | None = None

    @property
    def hooks(self) -> Compression:
        assert self.compression is not None  # set by Engine.compressed
        return self.compression


PLAIN = (DynamicLayer, DynamicSlidingWindowLayer)  # layers whose multi-token append equals token-by-token appends


def one_forward(method: Method, start: Compressed) -> bool:
    """Whether tokens fed to `start`'s cache in one forward (as `Engine._extend` feeds a suffix) give what decoding
    them gives (fidelity feeds a row the full answer so)."""
    layers = start.cache.layers
    return (
        not start.hooks.acts_while_decoding
        and not method.caps.extends_token_by_token
        and all(type(layer) in PLAIN for layer in layers)
        and one_mask(start.cache)
    )


class Engine:
    def __init__(self, lm: LoadedModel, full: LoadedModel | None = None, graphs: bool = False):
        self.lm = lm
        self.graphs = graphs  # decode_graph: plain configurations decode by a captured CUDA graph (graph_decode.py)
        # kv_bytes_full always refers to the original model (head merging runs on a converted copy)
        self.full_lm = full or lm
        self.full_layout = self.full_lm.layout
        self.full_kv_heads = self.full_lm.n_kv_heads
        self._prepared: dict[tuple, Engine] = {}  # (method, params) → the engine on the model it prepares (`prepared`)
        if lm.device.type == "cuda" and os.environ.get("KVBENCH_CUDNN_SDPA") != "1":
            # cuDNN's SDPA builds an execution plan per new key length: a growing decode cache (and PyramidKV's
            # per-layer lengths) then pays it every step. Flash / memory-efficient kernels have no such cost.
            torch.backends.cuda.enable_cudnn_sdp(False)
        cpu = backend("cpu") if lm.device.type == "cpu" else None
        if cpu is not None:  # the C kernels' first build (~1 s each, once per machine) before any timing; decode
            cpu.install(lm.model)  # steps row-independent (grids decode as one batch), and faster
        self.weight_bytes = weight_bytes(lm.model)  # what every decode step reads besides the cache
        eos = lm.tokenizer.eos_token_id
        chat_ends = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")
        vocab = lm.tokenizer.get_vocab()
        self.eos_ids = {eos} | {lm.tokenizer.convert_tokens_to_ids(t) for t in chat_ends if t in vocab}

    # ---- forward ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, ids: list[int], positions: list[int], cache, all_logits: bool = False, fp32: bool = True
    ) -> torch.Tensor:
        """The model's forward on `ids` at `positions`, appending to `cache` (kvbench.model.load.LoadedModel)."""
        return self.lm.forward(ids, positions, cache, all_logits, fp32)

    @torch.inference_mode()
    def prefill(self, ids: list[int], request: StatsRequest, cache=None, position: int = 0) -> Prefill:
        """Forward the whole prompt once, recording the statistics `request` asks for. With a `cache` already
        holding `position` tokens (a reused prefix), `ids` are the rest of the prompt, at positions from there."""
        device = self.lm.device
        cache = cache if cache is not None else new_cache(self.lm.layout)
        baseline = reset_peak(device)
        synchronize(device)
        start = time.perf_counter()
        with recording(request) as stats:
            logits = self.forward(ids, list(range(position, position + len(ids))), cache)
        synchronize(device)
        seconds = time.perf_counter() - start
        self._check_recorded(request, stats, len(cache.layers))
        kv = cache_kv(cache)
        if position == 0:  # the whole prompt: methods that re-read it (kvzip) find it with the statistics
            stats.prompt = PromptSource(self.lm, list(ids), kv, lambda: synchronize(device), lambda: read_peak(device))
        states = state_layers(cache, self.lm.layout)
        return Prefill(kv, stats, logits[-1], seconds, read_peak(device), baseline_bytes=baseline, states=states)

    def _check_recorded(self, request: StatsRequest, stats: StatsRecorder, n_layers: int) -> None:
        recorded = [len(stats.all_queries)] if request.all_queries else []
        recorded += [len(stats.window.get(w, {})) for w in request.windows]
        if any(n != n_layers for n in recorded):
            raise KvbenchError(
                f"this method needs attention statistics, but {type(self.lm.model).__name__}'s attention did not "
                f"report them; supported: models whose attention goes through transformers' AttentionInterface "
                f"with one KV cache layer per decoder layer (Llama, Mistral, Qwen2/3, Gemma, Phi-3 and similar)"
            )

    # ---- one configuration --------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prefill: Prefill,
        method: Method,
        budget: Budget | None,
        suffix_ids: list[int],
        max_new_tokens: int,
        stop: tuple[str, ...] = (),
        keep_logits: bool = False,
    ) -> Generation:
        """Compress `prefill` with `method`, feed `suffix_ids` uncompressed, then decode greedily."""
        start = self.compressed(prefill, method, budget, suffix_ids, max_new_tokens)
        return self.decode(start, method, max_new_tokens, stop, keep_logits)

    @torch.inference_mode()
    def compressed(
        self,
        prefill: Prefill,
        method: Method,
        budget: Budget | None,
        suffix_ids: list[int],
        max_new_tokens: int | None = None,
    ) -> Compressed:
        """The first half of `generate`: compress, append the suffix; the cache and logits decoding starts from.
        `max_new_tokens` (None: unknown) tells which sliding layers this run never fills (`window_layout`)."""
        device = self.lm.device
        prompt = prefill.stats.prompt  # what methods derive from it is shared by a grid, charged to each
        mark = prompt.mark() if prompt is not None else (0, 0)
        start_bytes = reset_peak(device)
        start = time.perf_counter()
        method.bind(self.lm)
        cache, compression = prefill.compressed, prefill.compression  # prefill=inline: compressed in the forward
        if cache is None:
            compression = method.begin(prefill.n_tokens, len(prefill.kv), budget)
            cache = compression.run(prefill.kv, prefill.stats)
            layout = self.window_layout(prefill.n_tokens + len(suffix_ids), max_new_tokens)
            keep_windows(cache, prefill.kv, layout)  # sliding layers hold their window, as the model's own
            if prefill.states:  # a hybrid: its linear/Mamba/conv layers' states after the prompt, a copy of its own
                attach_states(cache, prefill.states, layout)
        elif compression is None:  # a hooked prefill's cache: nothing happens while decoding
            compression = Compression(method, prefill.n_tokens, self.lm.n_layers, None)
        if prefill.adopt is not None:
            cache = prefill.adopt(cache)
        logits, position = prefill.last_logits, prefill.n_tokens
        if suffix_ids:
            logits = self._extend(cache, compression, suffix_ids, position)
            position += len(suffix_ids)
        synchronize(device)
        reused_s, reused_peak = prompt.charge_since(mark) if prompt is not None else (0.0, 0)
        prefill_s = prefill.seconds_for(method) + time.perf_counter() - start + reused_s
        peak = max(prefill.peak_mem_bytes, read_peak(device), reused_peak)
        suffix = position - prefill.n_tokens
        return Compressed(
            cache, logits, position, prefill.n_tokens, suffix, prefill_s, peak, prefill.baseline_bytes, start_bytes,
            compression,
        )  # fmt: skip

    def logits_buffer(self, start: Compressed, max_new_tokens: int) -> torch.Tensor | None:
        """(max_new_tokens, V) fp32 zeros for `decode`'s kept distributions (the fidelity columns read a row's own
        decoding), allocated before the decode is measured; None past KEEP_LOGITS_BYTES."""
        width = start.logits.numel()
        if max_new_tokens * width * 4 > KEEP_LOGITS_BYTES:
            return None
        return torch.zeros(max_new_tokens, width, device=self.lm.device)  # (N, V)

    def window_layout(self, fed_tokens: int, max_new_tokens: int | None):
        """The layout at the most tokens this run feeds the cache (the prompt, the appended suffix and every decoded
        token but the last): a sliding layer whose window never fills holds every token, as a global layer does, so
        the method compresses it (kvbench.model.layout.CacheLayout.at). Decode length unknown: the model's windows."""
        if max_new_tokens is None:
            return self.lm.layout
        return self.lm.layout.at(fed_tokens + max(max_new_tokens - 1, 0))

    @torch.inference_mode()
    def decode(
        self,
        start: Compressed,
        method: Method,
        max_new_tokens: int,
        stop: tuple[str, ...] = (),
        keep_logits=False,
        logits_buffer: torch.Tensor | None = None,
    ) -> Generation:
        """The second half of `generate`: greedy decoding of one configuration from its compressed cache. keep_logits:
        the Generation keeps the distribution each token was read from; into `logits_buffer` (max_new_tokens, V) fp32
        when given — allocated before a measurement, keeping them then adds nothing to the decode's peak."""
        device, tokenizer = self.lm.device, self.lm.tokenizer
        cache, logits, position = start.cache, start.logits, start.position
        token = int(logits.argmax())
        keep_logits = keep_logits or logits_buffer is not None
        generated, kept_logits = [token], [logits] if keep_logits else []
        if logits_buffer is not None:
            kept_logits = [logits_buffer[0].copy_(logits)]  # views of the buffer: step i's row i
        steps, t0 = 0, time.perf_counter()
        hooks = start.hooks
        hooks.on_decode_start(cache, position)
        graph = GraphStep(self.lm, start, max_new_tokens) if self.graphs and graph_applies(self.lm, start) else None
        slots = graph is None and use_slots(cache, hooks, self.lm.model)  # evictions in place, appends into slots
        while len(generated) < max_new_tokens and token not in self.eos_ids:
            if stop and any(s in tokenizer.decode(generated, skip_special_tokens=True) for s in stop):
                break
            if graph is not None:  # the static step, replayed (its logits buffer is the next step's too)
                logits = graph(token)
            else:
                with recording(hooks.decode_request()) as stats:
                    logits = self.forward([token], [hooks.position(position, cache)], cache)[-1]
                hooks.on_decode_step(cache, stats)
            position, steps = position + 1, steps + 1
            token = int(logits.argmax())
            generated.append(token)
            if logits_buffer is not None:
                kept_logits.append(logits_buffer[len(generated) - 1].copy_(logits))
            elif keep_logits:
                kept_logits.append(logits.clone() if graph is not None else logits)
        synchronize(device)
        decode_s = time.perf_counter() - t0 - (graph.capture_s if graph is not None else 0.0)  # capture: setup
        if graph is not None:
            graph.finish()  # exact-size tensors again, as below
        if slots:
            plain_layers(cache)  # exact-size tensors again: kv_bytes counts what a plain cache would hold
        peak = max(start.prefill_peak, read_peak(device))
        return Generation(
            token_ids=generated,
            text=self.answer_text(generated, stop),
            context_tokens=start.position,
            prefill_s=start.prefill_s,
            decode_s=decode_s,
            decode_steps=steps,
            kv_bytes=cache_nbytes(cache),
            **self.baselines(start.position + steps),
            peak_mem_bytes=peak,
            logits=kept_logits,
            peak_mem_delta_bytes=peak - start.baseline_bytes,
        )

    def baselines(self, tokens: int, batch: int = 1) -> dict[str, Any]:  # ints; Any: spread into dataclasses
        """The uncompressed caches a row compares with at `tokens` tokens (kvbench.model.layout): the original
        model's own (`kv_bytes_full`: sliding layers at their window), every token in every layer
        (`kv_bytes_full_dense`), and one KV head per query head (`kv_bytes_mha`)."""
        layout = self.full_layout
        return {
            "kv_bytes_full": layout.full_bytes(tokens, batch),
            "kv_bytes_full_dense": layout.dense_bytes(tokens, batch),
            "kv_bytes_mha": layout.mha_bytes(tokens, batch),
        }

    def _extend(
        self, cache, hooks: Compression, ids: list[int], position: int, all_logits: bool = False
    ) -> torch.Tensor:
        """Append `ids` after compression (the question when query_aware=false; a scored continuation);
        returns the last logits (V,), or with all_logits every position's (len(ids), V).

        One forward when one mask fits every layer (kvbench.model.cache.one_mask); token by token otherwise.
        """
        hooks.on_extend(len(ids))  # the appended question is not part of the compressed budget
        one_forward = one_mask(cache) and not hooks.method.caps.extends_token_by_token
        chunks = [ids] if one_forward else [[t] for t in ids]  # decode-time compression: appended = decode steps
        outputs = []
        for chunk in chunks:
            base = hooks.position(position, cache)  # rolling positions count inside the cache
            positions = [base + i for i in range(len(chunk))]
            with recording(hooks.decode_request()) as stats:
                outputs.append(self.forward(chunk, positions, cache, all_logits=all_logits))  # (len(chunk) or 1, V)
            hooks.on_decode_step(cache, stats)
            position += len(chunk)
        return torch.cat(outputs) if all_logits else outputs[-1][-1]

    def answer_text(self, token_ids: list[int], stop: tuple[str, ...]) -> str:
        """The generated ids as text: end-of-turn ids dropped, cut before the first stop string (each in turn)."""
        kept = [t for t in token_ids if t not in self.eos_ids]
        text = cast(str, self.lm.tokenizer.decode(kept, skip_special_tokens=True))  # one sequence → one string
        for s in stop:
            text = text.split(s)[0] if s in text else text
        return text

    @torch.inference_mode()
    def hooked_generate(
        self,
        method: HooksPrefill,
        budget: Budget | None,
        prompt_ids: list[int],
        suffix_ids: list[int],
        max_new_tokens: int,
        stop: tuple[str, ...] = (),
        keep_logits: bool = False,
    ) -> Generation:
        """A method compressing by hooks of its own (methods/modes.py's HooksPrefill, kvpress's presses): the
        prompt's forward inside its `hooked_prefill` — the time and peak of the prefill are its own, compression
        included — then `generate` from the cache its hooks left, inside its `hooked_decode`."""
        from transformers import DynamicCache

        device, cache = self.lm.device, DynamicCache()
        baseline = reset_peak(device)
        synchronize(device)
        start = time.perf_counter()
        with method.hooked_prefill(self.lm, len(prompt_ids), budget):
            logits = self.forward(list(prompt_ids), list(range(len(prompt_ids))), cache)
        synchronize(device)
        seconds = time.perf_counter() - start
        prefill = Prefill(
            [],
            StatsRecorder(StatsRequest()),
            logits[-1],
            seconds,
            read_peak(device),
            baseline_bytes=baseline,
            compressed=cache,
            prompt_tokens=len(prompt_ids),
        )
        with method.hooked_decode(self.lm):
            return self.generate(
                prefill, cast(Method, method), budget, list(suffix_ids), max_new_tokens, stop, keep_logits=keep_logits
            )

    def prepared(self, method: Method) -> Engine:
        """An engine on the model `method` prepares (head merging), reused across examples; self if unchanged."""
        key = (method.name, json.dumps(method.params(), sort_keys=True, default=str))
        cache = self._prepared
        if key not in cache:
            model = method.prepare_model(self.lm.model) if isinstance(method, ChangesModel) else self.lm.model
            cache[key] = (
                self if model is self.lm.model else Engine(replace(self.lm, model=model), self.full_lm, self.graphs)
            )
        return cache[key]

    def run(
        self,
        method: Method,
        budget: Budget | None,
        prompt_ids: list[int],
        suffix_ids: Sequence[int] = (),
        max_new_tokens: int = 32,
        stop: tuple[str, ...] = (),
        keep_logits: bool = False,
    ) -> Generation:
        """Prefill + generate for a single configuration."""
        engine = self.prepared(method)
        prefill = engine.prefill(list(prompt_ids), method.stats_request())
        return engine.generate(prefill, method, budget, list(suffix_ids), max_new_tokens, stop, keep_logits)
