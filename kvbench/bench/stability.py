"""Does a method keep the same tokens in bf16 as in fp32? Kept-set overlap and ties at the cut, per configuration.

    python -m kvbench.bench stability [overrides]   # e.g. 'grid.method=[knorm,snapkv,tova]' 'grid.budget=[0.25]'

No `bench.` options: the run's own overrides (model, task, method or grid.method, budget, limit) say what to compare,
as `python -m kvbench` reads them. Every example's prompt is prefilled in float32 and in bfloat16 and compressed by
each configuration; per layer and KV head the overlap of the two kept sets (|kept_fp32 ∩ kept_bf16| / kept), and for
scorers (methods with per-head `scores`) in each dtype the share of a head's scores equal to another of its scores
(`tied`; kvpress #276 found ~74 % for Knorm in bf16) and the share of heads whose cut — the lowest kept score — falls
inside a tie (`cut in a tie`: there the kept set is decided by the order ties are broken in, not by the scores).
Prints one line per configuration and each layer's mean overlap. The full cache, quantization and hooked presses are
refused (nothing to compare): eviction methods only, on a generating task.

    python -m kvbench.bench stability model=smollm2-135m task=niah 'task.context_lengths=[2048]' \
        'task.depths=[0.5]' 'grid.method=[knorm,snapkv,tova,keydiff]' 'grid.budget=[0.25]'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench import KvbenchError
from kvbench.bench.common import checked, header, options
from kvbench.methods import Method
from kvbench.methods.modes import HooksPrefill

DTYPES = ("float32", "bfloat16")


@dataclass
class Kept:
    """One configuration on one example in one dtype: per layer the kept positions (H_kv, N) (None: kept whole) and,
    for a scorer, per layer the (H_kv,) tied share and whether each head's cut is inside a tie."""

    positions: list[torch.Tensor | None]
    tied: list[torch.Tensor] = field(default_factory=list)
    cut_tied: list[torch.Tensor] = field(default_factory=list)


def tie_stats(scores: torch.Tensor, n_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (H, T) of one layer, n_keep kept: per head the share of finite scores equal to another finite score
    of the head (H,), and whether the n_keep-th highest score is shared by another position (H,) bool."""
    ordered = scores.sort(dim=-1, descending=True).values  # (H, T)
    finite = torch.isfinite(ordered)  # (H, T): +inf marks always-kept positions (windows, sinks)
    same = ordered[:, 1:] == ordered[:, :-1]  # (H, T−1): equal to the next in order
    dup = torch.zeros_like(finite)
    dup[:, 1:] |= same
    dup[:, :-1] |= same  # (H, T): an entry with an equal neighbour in sorted order
    tied = (dup & finite).sum(-1) / finite.sum(-1).clamp_min(1)  # (H,)
    cut = ordered[:, n_keep - 1 : n_keep]  # (H, 1) the lowest kept score
    cut_tied = ((ordered == cut) & finite).sum(-1) > 1  # (H,)
    return tied.float(), cut_tied


def kept_sets(engine, method: Method, budget, prompt_ids: list[int]) -> Kept:
    """Compress `prompt_ids`' prefill with `method` and read what it kept (its Compression's `kept`)."""
    prefill = engine.prefill(prompt_ids, method.stats_request())
    method.bind(engine.lm)
    compression = method.begin(prefill.n_tokens, len(prefill.kv), budget)
    compression.run(prefill.kv, prefill.stats)
    positions = [None if p is None else p[0].cpu() for p in (compression.kept or [])]  # (H_kv, N) per layer
    out = Kept(positions)
    if type(method).scores is Method.scores:
        return out
    for layer, (keys, values) in enumerate(prefill.kv):
        kept = positions[layer]
        if kept is None:
            continue
        scores = method.scores(layer, keys, values, prefill.stats)[0].float().cpu()  # (H_kv, T)
        tied, cut_tied = tie_stats(scores, kept.shape[-1])
        out.tied.append(tied)
        out.cut_tied.append(cut_tied)
    return out


def overlap(a: Kept, b: Kept) -> list[torch.Tensor]:
    """Per evicting layer (H_kv,): the share of a's kept positions b keeps too (the counts are equal)."""
    out = []
    for pa, pb in zip(a.positions, b.positions):
        if pa is None or pb is None:
            continue
        hits = (pa[:, :, None] == pb[:, None, :]).any(-1).sum(-1)  # (H_kv,)
        out.append(hits.float() / pa.shape[-1])
    return out


def measure(spec, confs, examples_of) -> list[dict]:
    """Per configuration: the overlap and tie figures over the examples (`examples_of(tokenizer)`)."""
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine

    results: dict[str, list[Kept]] = {}
    for dtype in DTYPES:
        engine = Engine(load_model(spec.model, spec.device, dtype))
        header("stability", engine.lm)
        for ex in examples_of(engine.lm):
            for c in confs:
                prompt_ids, _ = ex.split(c.query_aware)
                results.setdefault(f"{dtype}|{id(c)}", []).append(kept_sets(engine, c.method, c.budget, prompt_ids))
        del engine
    table = []
    for c in confs:
        fp32, bf16 = results[f"float32|{id(c)}"], results[f"bfloat16|{id(c)}"]
        per_layer = [torch.stack(overlap(a, b)) for a, b in zip(fp32, bf16)]  # (L_evicting, H_kv) per example
        if not per_layer or per_layer[0].numel() == 0:
            raise KvbenchError(
                f"{c.method.name} at budget {c.budget_value:g} evicted nothing: raise the prompt or lower the budget"
            )
        grid = torch.stack(per_layer)  # (E, L, H_kv)
        row = {
            "method": c.method.name,
            "budget": c.budget_value,
            "examples": grid.shape[0],
            "overlap_mean": float(grid.mean()),
            "overlap_min": float(grid.min()),
            "heads_differ": float((grid < 1).float().mean()),
            "overlap_by_layer": grid.mean(dim=(0, 2)).tolist(),
        }
        for dtype, kept in (("fp32", fp32), ("bf16", bf16)):
            tied = [t for k in kept for t in k.tied]
            row[f"tied_{dtype}"] = float(torch.cat(tied).mean()) if tied else float("nan")
            cut = [t for k in kept for t in k.cut_tied]
            row[f"cut_in_tie_{dtype}"] = float(torch.cat(cut).float().mean()) if cut else float("nan")
        table.append(row)
    return table


def render(table: list[dict]) -> str:
    """The table as text: one line per configuration, then each one's overlap per layer."""
    head = (
        f"{'method':<22}{'budget':>7}{'n':>4}{'overlap':>9}{'min':>7}{'heads≠':>8}"
        f"{'tied fp32':>11}{'tied bf16':>11}{'cut∈tie fp32':>14}{'cut∈tie bf16':>14}"
    )

    def pct(x: float) -> str:
        return "–" if x != x else f"{100 * x:.1f}%"

    lines = [head]
    for r in table:
        lines.append(
            f"{r['method']:<22}{r['budget']:>7g}{r['examples']:>4}{r['overlap_mean']:>9.4f}{r['overlap_min']:>7.3f}"
            f"{pct(r['heads_differ']):>8}{pct(r['tied_fp32']):>11}{pct(r['tied_bf16']):>11}"
            f"{pct(r['cut_in_tie_fp32']):>14}{pct(r['cut_in_tie_bf16']):>14}"
        )
    lines.append("")
    lines.append("kept-set overlap per evicting layer (mean over KV heads and examples), first layer first:")
    for r in table:
        values = " ".join(f"{v:.3f}" for v in r["overlap_by_layer"])
        lines.append(f"  {r['method']} {r['budget']:g}: {values}")
    return "\n".join(lines)


def main(overrides: list[str]) -> None:
    _, overrides = options(overrides, {}, "stability")  # no options of its own: a `bench.` key is one line
    spec, confs = evicting(*checked(overrides))
    print(render(measure(spec, confs, lambda lm: examples(spec, lm))))


def evicting(spec, confs: list) -> tuple:
    """The run's spec and its evicting configurations (the full cache, quantization and hooked presses refused)."""
    confs = [c for c in confs if c.method.name != "full"]
    for c in confs:
        m = c.method
        if isinstance(m, HooksPrefill) or not m.caps.has_budget or not m.caps.shares_prefill:
            raise KvbenchError(
                f"method {m.name}: the stability check compares the prompt positions an eviction method keeps when it "
                f"compresses; use e.g. grid.method=[knorm,snapkv,tova,keydiff,triattention]"
            )
    if spec.task_name == "ppl" or not confs:
        raise KvbenchError("give a generating task and at least one eviction method, e.g. task=niah method=knorm")
    return spec, confs


def examples(spec, lm) -> list:
    from kvbench.tasks import build_task

    task = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context)
    found = task.examples()
    return found[: spec.limit] if spec.limit else found
