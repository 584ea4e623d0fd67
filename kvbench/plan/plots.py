"""The planner's region plot: over context × batch, where decode is bandwidth-bound, compute-bound or out of memory
(one panel per configuration), with each cell's roofline tokens/s."""

from __future__ import annotations

from pathlib import Path

import numpy as np

REGIONS = {"bandwidth": 0, "compute": 1, "oom": 2}
COLORS = ["#9ecae1", "#fdae6b", "#d9d9d9"]
CONTEXTS = [2**k for k in range(10, 21)]  # 1K .. 1M
BATCHES = [2**k for k in range(0, 10)]  # 1 .. 512


def region_plot(cfg, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from kvbench.config.spec import RunSpec
    from kvbench.model.load import resolve_dtype
    from kvbench.plan.hardware import build_hardware
    from kvbench.plan.model import arch_of, plan_point
    from kvbench.plan.reuse import Reuse
    from kvbench.rows.configuration import configurations
    from kvbench.store.aggregate import variant_label
    from kvbench.store.results import write_atomic

    hw, arch, dtype = build_hardware(cfg.hardware), arch_of(cfg.model), resolve_dtype(cfg.dtype)
    confs = configurations(RunSpec.of(cfg))
    reuse = Reuse.from_cfg(cfg)  # a context shorter than the prefix shares all of it
    fig, axes = plt.subplots(1, len(confs), figsize=(4.2 * len(confs), 4.2), squeeze=False, sharey=True)
    for ax, c in zip(axes[0], confs):
        grid = np.zeros((len(BATCHES), len(CONTEXTS)), dtype=int)  # (batches, contexts)
        for i, batch in enumerate(BATCHES):
            for j, context in enumerate(CONTEXTS):
                point = plan_point(
                    arch, hw, c.method, c.budget, dtype, context, batch, float(cfg.headroom), limits=False, reuse=reuse
                )
                grid[i, j] = REGIONS[point["decode_bound"]]
                if point["fits"] and i % 3 == 0 and j % 2 == 0:
                    ax.text(j, i, f"{point['decode_tokens_per_s_bound']:.0f}", ha="center", va="center", fontsize=6)
        ax.imshow(grid, origin="lower", cmap=ListedColormap(COLORS), vmin=0, vmax=2, aspect="auto")
        ax.set_xticks(range(len(CONTEXTS)), [f"{c // 1024}K" for c in CONTEXTS], rotation=90, fontsize=7)
        ax.set_yticks(range(len(BATCHES)), [str(b) for b in BATCHES], fontsize=7)
        label = variant_label(c.method.name, c.method.params())
        ax.set_title(f"{label}" + (f" budget {c.budget_value:g}" if c.budget else ""), fontsize=9)
        ax.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("batch (requests)")
    fig.legend(
        handles=[Patch(color=col, label=name) for name, col in zip(REGIONS, COLORS)],
        loc="upper right",
        ncol=3,
        fontsize=8,
    )
    fig.suptitle(
        f"{arch.name} on {hw.name} ({str(dtype).removeprefix('torch.')}, headroom {cfg.headroom}): decode "
        f"bound per step; numbers = roofline tokens/s",
        fontsize=9,
        x=0.01,
        ha="left",
    )
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path
