"""The running requests' caches as the rows of one batch, rows joining and leaving between decode steps.

It reuses the grid decoder's pieces (kvbench.native.grid_decode): each layer is a `GridLayer` holding row r's
tokens left-aligned in slots [0, lengths[r]) of one (B, H_kv, capacity, D) tensor; the attention function runs each
row over its own slots (`PaddedKV`: the C kernel's row-independent decode on the CPU, else the batch-1 call per
row), so a row decodes with the bits it has alone. What serving adds: rows at their own positions (each request's
next token sits at its own RoPE position), a row joining a batch already decoding (`join`: the layer's tensors
grow by one row, copied once), and a row leaving (finished or preempted: `GridLayer.keep_rows`).

Decode-time eviction (H2O, StreamingLLM, TOVA) runs each row's own method on a batch-1 view of its row after the
step, with the row's slice of the step's statistics — as grid decoding does — so every row keeps what it keeps
alone. The pad slots are memory of the dense CPU batch, not of the request: `held_bytes` counts each row's own
tokens (what a paged cache would hold), `padded_bytes` the batch's tensors.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvbench.model.attention import StatsRequest, recording
from kvbench.native.batched import forward_batch
from kvbench.native.grid_decode import GROW, GridLayer, RowsRecorder, decode_step_on_row


def join(layer: GridLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Row len(layer.lengths) of `layer` now holds keys/values (1, H_kv, n, D); capacity grows to fit it."""
    n = keys.shape[2]
    capacity = layer.keys.shape[2]
    if n > capacity:
        pad = layer.keys.new_zeros(*layer.keys.shape[:2], n + GROW - capacity, layer.keys.shape[3])  # (B, H, +, D)
        layer.keys, layer.values = torch.cat([layer.keys, pad], 2), torch.cat([layer.values, pad], 2)
        capacity = layer.keys.shape[2]
    row_k = layer.keys.new_zeros(1, keys.shape[1], capacity, keys.shape[3])  # (1, H_kv, capacity, D): finite pads
    row_v = layer.values.new_zeros(1, keys.shape[1], capacity, keys.shape[3])
    row_k[:, :, :n], row_v[:, :, :n] = keys, values
    layer.keys, layer.values = torch.cat([layer.keys, row_k]), torch.cat([layer.values, row_v])  # (B + 1, ...)
    layer.lengths.append(n)


class RowBatch:
    """Requests decoding together: `rows[i]` is the owner of batch row i (anything with `.hooks`, its
    compression, methods/compression.py)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cache: DynamicCache | None = None
        self.rows: list = []

    @property
    def grids(self) -> list[GridLayer]:
        return cast(list[GridLayer], self.cache.layers) if self.cache is not None else []

    def add(self, owner, cache: DynamicCache) -> None:
        """`owner` joins with its batch-1 cache of plain layers (copied into the batch's tensors)."""
        plain = cast(list[DynamicLayer], cache.layers)  # decodes_in_grid: plain layers only
        layers = [(cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)) for layer in plain]
        if self.cache is None:
            self.cache = DynamicCache()
            self.cache.layers.extend(GridLayer([kv]) for kv in layers)
        else:
            for grid, (k, v) in zip(self.grids, layers):
                join(grid, k, v)
        self.rows.append(owner)

    def remove(self, owner) -> None:
        index = self.rows.index(owner)
        keep = [i for i in range(len(self.rows)) if i != index]
        self.rows.pop(index)
        if not self.rows:
            self.cache = None  # the batch's tensors are freed with it
            return
        for grid in self.grids:
            grid.keep_rows(keep)

    def row_bytes(self, owner) -> int:
        """The row's own tokens' bytes (a plain cache of the same tokens: cache_nbytes of it)."""
        i = self.rows.index(owner)
        return sum(g.lengths[i] * 2 * g.keys[0, :, 0].numel() * g.keys.element_size() for g in self.grids)

    def padded_bytes(self) -> int:
        return sum(g.keys.nbytes + g.values.nbytes for g in self.grids)

    @torch.inference_mode()
    def step(self, engine, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode forward for every row (row i feeds tokens[i] at positions[i]) and each row's decode-time
        policy after it; returns fp32 logits (B, V)."""
        hooks = [row.hooks for row in self.rows]
        merged = StatsRequest()
        for h in hooks:
            merged = merged | h.decode_request()
        asking = [i for i, h in enumerate(hooks) if h.decode_request()]
        ids = torch.tensor(tokens, device=self.device)[:, None]  # (B, 1)
        pos = torch.tensor(positions, device=self.device)[:, None]  # (B, 1)
        with recording(merged, RowsRecorder(merged, asking, self.device)) as stats:
            logits = forward_batch(engine, ids, pos, self.cache)  # (B, V)
        self._after_step(stats)
        return logits

    def _after_step(self, stats) -> None:
        """Each evicting row's policy on a batch-1 view of its own slots (kvbench.native.grid_decode.decode_grid)."""
        for i, row in enumerate(self.rows):
            if row.hooks.acts_while_decoding:  # else nothing to do while generating
                decode_step_on_row(self.grids, i, row.hooks, stats)
