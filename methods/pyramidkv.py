"""PyramidKV (Cai et al. 2024, https://arxiv.org/abs/2406.02069; Zefan-Cai/KVCache-Factory).

SnapKV's scoring with layer budgets that fall linearly from the first layer to the last, same total. With
per-layer capacity C, window W, L layers and β: min = (C − W) // β, max = 2(C − W) − min, and layer l keeps
max − l·((max − min) // (L − 1)) selected positions plus the window (KVCache-Factory's PyramidKVCluster,
including its clamp when max exceeds the prompt and its uniform SnapKV fallback for short prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods.base import METHODS
from kvbench.methods.snapkv import SnapKV


@METHODS.register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    beta: int = 20

    def layer_tokens(self, n_keep: int, n_layers: int, n_prompt: int) -> list[int]:
        window = self.window_size
        selected = n_keep - window  # C − W
        if n_prompt < 2 * selected or n_layers == 1:  # KVCache-Factory: short prompts fall back to SnapKV
            return [n_keep] * n_layers
        min_num = selected // self.beta
        max_num = 2 * selected - min_num
        if max_num >= n_prompt - window:
            max_num = n_prompt - window
            min_num = 2 * selected - max_num
        step = (max_num - min_num) // (n_layers - 1)
        return [max_num - layer * step + window for layer in range(n_layers)]
