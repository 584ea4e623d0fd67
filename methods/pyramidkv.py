"""PyramidKV (Cai et al. 2024, https://arxiv.org/abs/2406.02069; Zefan-Cai/KVCache-Factory).

SnapKV's scoring with layer budgets that fall linearly from the first layer to the last. With per-layer capacity
C, window W, L layers and β: min = (C − W) / β, max = 2(C − W) − min, and layer l keeps max − l·(max − min)/(L − 1)
selected positions plus the window (clamped when max exceeds the prompt; short prompts fall back to uniform
SnapKV, as KVCache-Factory's PyramidKVCluster does).

`schedule=exact` (default) takes that float step, as kvpress does, and rounds the running total, so the layers keep
exactly L·C tokens: the budget asked for. `schedule=kvcache_factory` is KVCache-Factory's integer arithmetic
(min = (C − W) // β, step = (max − min) // (L − 1)), whose floors overshoot: for C = 96, W = 32, L = 32 at a 4K
prompt it keeps 3,536 tokens against a 3,072 budget (+15 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, check_choice
from kvbench.methods.snapkv import SnapKV


@METHODS.register("pyramidkv")
@dataclass
class PyramidKV(SnapKV):
    beta: int = knob(20, min=1)  # min = (C − W) / β: 0 divides by zero
    schedule: str = "exact"  # exact (total = budget, kvpress's float step) | kvcache_factory (its integer step)

    def __post_init__(self):
        super().__post_init__()
        check_choice("schedule", self.schedule, ("exact", "kvcache_factory"))

    def layer_tokens(self, n_keep: int, n_layers: int, n_prompt: int) -> list[int]:
        window = self.window_size
        selected = n_keep - window  # C − W
        if n_prompt < 2 * selected or n_layers == 1:  # KVCache-Factory: short prompts fall back to SnapKV
            return [n_keep] * n_layers
        factory = self.schedule == "kvcache_factory"
        min_num = selected // self.beta if factory else selected / self.beta
        max_num = 2 * selected - min_num
        if max_num >= n_prompt - window:
            max_num = n_prompt - window
            min_num = 2 * selected - max_num
        if factory:
            step = (max_num - min_num) // (n_layers - 1)
            return [max_num - layer * step + window for layer in range(n_layers)]
        step = (max_num - min_num) / (n_layers - 1)
        # round the running total, not each layer: the layers then sum to exactly n_layers · selected
        totals = [math.floor(layer * max_num - step * layer * (layer - 1) / 2 + 1e-9) for layer in range(n_layers + 1)]
        return [totals[layer + 1] - totals[layer] + window for layer in range(n_layers)]
