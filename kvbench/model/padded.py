"""Keys or values of rows with their own lengths in one dense batch (kvbench.native.grid_decode), for the attention
function (kvbench.model.attention), which masks the pad slots. Kept apart so both import it without a cycle."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PaddedKV:
    """Dense keys or values and which slots hold a row's tokens."""

    tensor: torch.Tensor  # (B, H_kv, T, D); pad slots may hold anything (the grid never writes them)
    mask: torch.Tensor | None = None  # (B, 1, 1, T) bool, True = a token of that row; None: from `lengths`
    lengths: list[int] | None = None  # per row, its tokens: slots [0, n) (a decode step attends row by row)
    zero_pads: bool = False  # the pad slots hold zeros (kvbench.native.graph_decode): `dense` needs no copy

    def pad_mask(self) -> torch.Tensor | None:
        """(B, 1, 1, T) bool, True = a token of that row; None: no pads."""
        if self.mask is not None or self.lengths is None or min(self.lengths) == self.tensor.shape[2]:
            return self.mask
        slots = torch.arange(self.tensor.shape[2], device=self.tensor.device)  # (T,)
        return (slots < torch.tensor(self.lengths, device=self.tensor.device)[:, None])[:, None, None, :]

    def dense(self) -> torch.Tensor:
        """(B, H_kv, T, D) with the pads zeroed, for one masked attention call over the batch (a masked slot's
        value still enters the product: it must be finite)."""
        mask = self.pad_mask()  # (B, 1, 1, T)
        return self.tensor if mask is None or self.zero_pads else self.tensor.masked_fill(~mask.transpose(-1, -2), 0)
