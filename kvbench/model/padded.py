"""Keys or values of rows with their own lengths in one dense batch (kvbench.native.grid_decode), for the attention
function (kvbench.model.attention), which masks the pad slots. Kept apart so both import it without a cycle."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PaddedKV:
    """Dense keys or values and which slots hold a row's tokens."""

    tensor: torch.Tensor  # (B, H_kv, T, D)
    mask: torch.Tensor | None  # (B, 1, 1, T) bool, True = a token of that row; None = no pads
    lengths: list[int] | None = None  # per row, its tokens: slots [0, n) (a decode step attends row by row)
