"""A configuration's decode step captured once as a CUDA graph and replayed (`decode_graph=true`, CUDA only).

Why: an eager decode step of an 8B model launches about a thousand small kernels from Python, and on a GPU those
launches, not the bytes, set its time (22–30 ms/token on an H200 against a ~3.3 ms bandwidth bound:
docs/benchmarks.md). A replayed graph launches the step's kernels without Python. A graph needs static shapes and
addresses, so each layer's tokens live in a buffer of capacity n + the steps to come (zero past the held tokens); a
step writes its token at slot n + step — `step` a device tensor the graph itself advances — and attends over the
whole buffer under a length mask (`PaddedKV` with `zero_pads`: no copy per step). The next token goes in by a fill,
the logits come out in a static buffer, and Engine.decode's loop stays what it is: argmax, stop checks, kept logits.

What it takes: configurations whose decode adds one token per step and nothing else — plain full-attention layers of
batch 1 at their own positions, no decode-time eviction or statistics (full, SnapKV, PyramidKV, random, ...); other
configurations, window or hybrid models decode eagerly as before. The first WARMUP steps run eagerly on a side
stream (cuBLAS and the allocator initialise outside the capture), then the step is captured once per decode — its
seconds (`capture_s`) are not decode time, as a serving engine captures its graphs before it serves. At the end the
layers are plain exact-size tensors again, so kv_bytes is what eager decoding holds.

The masked attention over the buffer is not eager's kernel (sdpa without a mask over exactly the held tokens), so
logits can differ in the last bits: the configuration hash records the setting. tests/native/test_graph_decode.py
checks tokens and bytes against eager decoding — the static step on the CPU (no capture: what the graph replays),
the capture itself wherever CUDA is present.
"""

from __future__ import annotations

import contextlib
import time
from typing import cast

import torch
from transformers.cache_utils import DynamicLayer

from kvbench import KvbenchError
from kvbench.model.attention import NO_ATTENTION_INTERFACE
from kvbench.model.cache import kv_layer
from kvbench.model.padded import PaddedKV

WARMUP = 2  # eager steps before the capture (torch's CUDA graph notes: warm up on a side stream first)


class BufferLayer(DynamicLayer):
    """A layer's tokens in the first n slots of a (1, H_kv, capacity, D) buffer, zeros after; the step's token goes
    to slot n + step (`step`: a (1,) device tensor shared by the layers), and attention reads the whole buffer under
    a mask of the held slots — the same shapes and addresses every step."""

    keys: torch.Tensor  # (1, H_kv, capacity, D), never None once built
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, step: torch.Tensor):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.held = keys.shape[2]  # tokens before the decode
        self.keys = keys.new_zeros(1, keys.shape[1], capacity, keys.shape[3])  # (1, H_kv, capacity, D)
        self.values = values.new_zeros(1, values.shape[1], capacity, values.shape[3])  # (latent layers: own D)
        self.keys[:, :, : self.held], self.values[:, :, : self.held] = keys, values
        self.first_slot = torch.full((1,), self.held, dtype=torch.long, device=keys.device)  # (1,)
        self.slots = torch.arange(capacity, device=keys.device)  # (capacity,)
        self.step = step

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the step's (1, H_kv, 1, D) into slot held + step; the buffers and the mask of held slots."""
        slot = self.first_slot + self.step  # (1,)
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        mask = (self.slots <= slot)[None, None, None, :]  # (1, 1, 1, capacity): the held tokens and the step's
        return PaddedKV(self.keys, mask, zero_pads=True), PaddedKV(self.values, mask, zero_pads=True)

    def exact(self, steps: int) -> DynamicLayer:
        """A plain layer of the held tokens and `steps` decoded ones (a copy: what kv_bytes measures)."""
        n = self.held + steps
        return kv_layer(self.keys[:, :, :n].clone(), self.values[:, :, :n].clone())  # (1, H_kv, n, D)


def capacity(tokens: int) -> int:
    """A buffer's slots: the tokens rounded up to 16 (sdpa's memory-efficient kernel pads a mask to that anyway)."""
    return -(-tokens // 16) * 16


def applies(lm, start) -> bool:
    """Whether this configuration's decode can be one static step: plain batch-1 full-attention layers at their
    own positions, nothing acting on decode steps, a model without window, latent (MLA) or recurrent layers whose
    attention goes through transformers' AttentionInterface (kvbench's attention function reads the buffers)."""
    hooks, layers = start.hooks, start.cache.layers
    return (
        all(kind.kind == "global" for kind in lm.layout.layers)  # per-head K/V of every token: no window, no latent
        and not lm.layout.is_hybrid
        and lm.config.model_type not in NO_ATTENTION_INTERFACE  # attention that reads the cache's tensors itself
        and not hooks.acts_while_decoding
        and not hooks.method.caps.decodes_alone
        and bool(layers)
        and all(type(layer) is DynamicLayer and cast(torch.Tensor, layer.keys).shape[0] == 1 for layer in layers)
        and hooks.position(start.position, start.cache) == start.position
    )


def check_setting(enabled: bool, device: torch.device) -> None:
    """decode_graph=true needs a CUDA device: one line otherwise (the CPU's decode steps are the C kernels')."""
    if enabled and device.type != "cuda":
        raise KvbenchError(
            f"decode_graph=true captures CUDA graphs; this run is on {device.type}, where decode steps run kvbench's "
            "C kernels: use device=cuda or decode_graph=false"
        )


class GraphStep:
    """One configuration's decode steps as a static step over BufferLayers: `step(token)` → the (V,) fp32 logits
    the token's forward gives (a buffer the next step overwrites). capture=False runs every step eagerly — what the
    graph replays, for a machine without CUDA (tests). `finish()` puts exact-size plain layers back in the cache."""

    @torch.inference_mode()
    def __init__(self, lm, start, max_new_tokens: int, capture: bool = True):
        device = lm.device
        self.lm, self.cache, self.capture = lm, start.cache, capture and device.type == "cuda"
        self.step_count = torch.zeros(1, dtype=torch.long, device=device)  # (1,) steps taken, advanced by the step
        extra = max(max_new_tokens - 1, 0)  # forwards a decode of max_new_tokens makes at most
        self.layers = [
            BufferLayer(layer.keys, layer.values, capacity(layer.keys.shape[2] + extra), self.step_count)
            for layer in start.cache.layers
        ]
        self.cache.layers[:] = self.layers
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=device)  # (1, 1) the step's token
        self.position = torch.full((1, 1), start.position, dtype=torch.long, device=device)  # (1, 1)
        self.logits: torch.Tensor | None = None  # (V,) fp32, made by the first (eager) step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps, self.capture_s = 0, 0.0

    def _forward(self) -> None:
        """The static step: the token's forward at its position, logits out, position and step advanced."""
        out = self.lm.model(
            input_ids=self.ids, position_ids=self.position, use_cache=True, logits_to_keep=1,
            **{self.lm.cache_kwarg: self.cache},
        )  # fmt: skip
        if self.logits is None:  # an eager step: the graph's later steps write into it
            self.logits = out.logits[0, -1].float()  # (V,)
        else:
            self.logits.copy_(out.logits[0, -1])  # (V,)
        self.position.add_(1)
        self.step_count.add_(1)

    @torch.inference_mode()
    def __call__(self, token: int) -> torch.Tensor:
        self.ids.fill_(token)
        if self.graph is None and self.capture and self.steps >= WARMUP:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            with self._side_stream():
                self._forward()
        self.steps += 1
        assert self.logits is not None  # the first step is eager
        return self.logits

    @contextlib.contextmanager
    def _side_stream(self):
        """Eager steps before the capture run on a side stream (torch's CUDA graph warm-up); on the CPU, as they are."""
        if not self.capture:
            yield
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def _capture(self) -> None:
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # recorded, not run: the state is still the previous step's
                self._forward()
        except RuntimeError as error:  # something in the model's step syncs with the host or leaves the device
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise KvbenchError(
                f"decode_graph=true: {type(self.lm.model).__name__}'s decode step could not be captured as a CUDA "
                f"graph ({first}); use decode_graph=false"
            ) from error
        torch.cuda.synchronize()
        self.graph, self.capture_s = graph, time.perf_counter() - start

    def finish(self) -> None:
        """The cache's layers as plain exact-size tensors (the held tokens and the decoded ones)."""
        self.cache.layers[:] = [layer.exact(self.steps) for layer in self.layers]
        self.graph = None  # its memory pool goes with it
