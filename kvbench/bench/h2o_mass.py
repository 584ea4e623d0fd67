"""Why H2O loses the needle on NIAH: where its accumulated attention mass goes.

    python -m kvbench.bench h2o_mass [overrides]     # bundled model, the task's 9 prompts, budget 0.25
    python -m kvbench.bench h2o_mass 'task.context_lengths=[1024]' bench.json=h2o.json

For each NIAH prompt (the task's: default 1K–4K × depths 0.1/0.5/0.9) one prefill records every query's attention
onto every key (H2O's statistic, and SnapKV's window), then per layer and KV head:
- the share of the accumulated mass on the attention sinks (first 4 tokens), the needle sentence, the recent
  window H2O always keeps, the question, and the rest of the haystack — and the mass per token of each;
- which positions each selection keeps at the budget (`budget`, default 0.25): kvbench's H2O (score=sum, the
  original's statistic, summed over a KV head's query group), H2O score=mean (kvpress's ObservedAttentionPress
  normalisation: ÷ the queries a key received), the original FMInference/H2O real-drop scheme (per query head after
  repeat_kv, heavy = recent = budget/2), and SnapKV; reported as the share of needle tokens kept and where the heavy
  hitters sit;
- one prompt's kept positions, kvbench H2O vs the original (overlap per KV head).
Then each configuration decodes the answer from the shared prefill and is scored (exact, partial;
`bench.decode=false` skips it). `bench.json=FILE` writes every figure.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvbench.bench.common import checked, header, load, options

if TYPE_CHECKING:
    from kvbench.methods import Budget

OPTIONS = {"decode": True, "json": None}
SINKS = 4
CONFIGS = {  # label → (method, knobs); "original" is analysed only (it keeps per query head: no kvbench cache)
    "h2o (sum)": ("h2o", {}),
    "h2o (mean)": ("h2o", {"score": "mean"}),
    "snapkv": ("snapkv", {}),
}


def needle_span(ex, tokenizer) -> tuple[int, int]:
    """[start, end) of the needle sentence in the prompt: from ' One of the special magic' to its value's end."""
    ids = ex.context_ids + ex.question_ids
    marker = tokenizer(" One of the special magic", add_special_tokens=False)["input_ids"]
    value = tokenizer(ex.answers[0], add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(ids)) if ids[i : i + len(marker)] == marker)
    end = next(i for i in range(start, len(ids)) if ids[i : i + len(value)] == value) + len(value)
    return start, end + 1  # with the full stop


def original_h2o(columns: torch.Tensor, n_keep: int) -> torch.Tensor:
    """FMInference/H2O real-drop (utils_real_drop H2OKVCache_LayerWise): per query head, hh_score = attention summed
    over the queries; keep top-`heavy` of [: T − recent] + the recent window.
    columns (B, H_q, T) -> (B, H_q, n_keep)."""
    n_tokens = columns.shape[-1]
    recent = n_keep // 2
    from kvbench.methods.base import top_k_sorted

    heavy = top_k_sorted(columns[..., : n_tokens - recent], n_keep - recent)
    window = torch.arange(n_tokens - recent, n_tokens).expand(*columns.shape[:2], -1)
    return torch.cat([heavy, window], dim=-1)


def kept_positions(label: str, method, layer: int, prefill, n_keep: int) -> torch.Tensor:
    """(H, n_keep) positions the configuration keeps in `layer` (H = KV heads; query heads for the original)."""
    if label == "original":
        return original_h2o(prefill.stats.all_queries[layer], n_keep)[0]
    keys, values = prefill.kv[layer]
    fresh = method.begin(keys.shape[2], len(prefill.kv), None)  # a fresh example: no scores accumulated yet
    return fresh.select(layer, keys, values, prefill.stats, n_keep)[0]


def analyse(ex, prefill, methods: dict, budget: Budget, tokenizer) -> dict:
    n_tokens = prefill.n_tokens
    n_keep = budget.tokens(n_tokens)
    recent = methods["h2o (sum)"].recent_tokens(n_keep)
    start, end = needle_span(ex, tokenizer)
    n_question = len(ex.question_ids)
    region = torch.full((n_tokens,), 4)  # 0 sinks, 1 needle, 2 recent window, 3 question, 4 rest of the haystack
    region[n_tokens - recent :] = 2
    region[n_tokens - n_question :] = 3
    region[:SINKS] = 0
    region[start:end] = 1
    names = ["sinks", "needle", "recent", "question", "haystack"]
    n_layers = len(prefill.kv)
    mass = torch.zeros(5)
    for layer in range(n_layers):
        columns = prefill.stats.all_queries[layer][0].sum(0)  # (T,): summed over query heads
        mass += torch.zeros(5).index_add_(0, region, columns.cpu()) / columns.sum().cpu()
    mass /= n_layers
    sizes = torch.bincount(region, minlength=5).float()
    out = {
        "example_id": ex.example_id,
        "tokens": n_tokens,
        "needle": [start, end],
        "recent": recent,
        "mass_share": dict(zip(names, mass.tolist())),
        "mass_per_token_vs_haystack": dict(zip(names, (mass / sizes / (mass[4] / sizes[4])).tolist())),
        "needle_kept": {},
        "heavy_in_first_tenth": {},
    }
    for label in [*methods, "original"]:
        needle, early = [], []
        for layer in range(n_layers):
            kept = kept_positions(label, methods.get(label), layer, prefill, n_keep)  # (H, n_keep)
            needle.append(((kept >= start) & (kept < end)).sum(-1).float().mean() / (end - start))
            heavy = kept[:, : n_keep - recent] if label != "snapkv" else kept[:, :-32]
            early.append((heavy < n_tokens // 10).float().mean())
        out["needle_kept"][label] = float(torch.stack(needle).mean())
        out["heavy_in_first_tenth"][label] = float(torch.stack(early).mean())
    return out


def overlap_with_original(prefill, method, n_keep: int, group: int) -> float:
    """Mean Jaccard overlap of kvbench H2O's kept set per KV head with the original's per query head of its group."""
    scores = []
    for layer in range(len(prefill.kv)):
        ours = kept_positions("h2o (sum)", method, layer, prefill, n_keep)  # (H_kv, n_keep)
        theirs = kept_positions("original", None, layer, prefill, n_keep)  # (H_q, n_keep)
        for q_head in range(theirs.shape[0]):
            a, b = set(ours[q_head // group].tolist()), set(theirs[q_head].tolist())
            scores.append(len(a & b) / len(a | b))
    return sum(scores) / len(scores)


def prompts(engine, task, methods: dict, budget, opts: dict, lm) -> list[dict]:
    """Each prompt's analysis (and, with bench.decode, each configuration's score), one prefill per prompt."""
    from kvbench.methods import build_method

    request = methods["h2o (sum)"].stats_request() | methods["snapkv"].stats_request()
    report: list[dict] = []
    for ex in task.examples():
        prompt, suffix = ex.split(query_aware=True)
        prefill = engine.prefill(prompt, request)
        row = analyse(ex, prefill, methods, budget, lm.tokenizer)
        if not report:  # one prompt's kept positions, kvbench vs the original
            row["jaccard_h2o_vs_original"] = overlap_with_original(
                prefill, methods["h2o (sum)"], budget.tokens(prefill.n_tokens), lm.n_q_heads // lm.n_kv_heads
            )
        if opts["decode"]:
            row["score"] = {}
            for label, method in [*methods.items(), ("full", build_method("full"))]:
                gen = engine.generate(
                    prefill, method, None if label == "full" else budget, suffix, ex.max_new_tokens, ex.stop
                )
                row["score"][label] = task.score(gen.text, ex)
        report.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return report


def main(overrides: list[str]) -> None:
    from kvbench.methods import Budget, build_method
    from kvbench.native.engine import Engine
    from kvbench.tasks import build_task

    opts, overrides = options(overrides, OPTIONS, "h2o_mass")
    spec, _ = checked(overrides, "method=h2o", "budget=0.25")
    lm = load(spec)
    task = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context)
    engine, budget = Engine(lm), Budget.parse(spec.budget)
    methods = {label: build_method(name, knobs) for label, (name, knobs) in CONFIGS.items()}
    for method in methods.values():
        method.bind(lm)
    header("h2o_mass", lm)
    start = time.perf_counter()
    report = prompts(engine, task, methods, budget, opts, lm)
    print_tables(report, spec, lm, time.perf_counter() - start)
    if opts["json"]:
        Path(opts["json"]).write_text(json.dumps(report, indent=1))


def mean(report: list[dict], *path: str) -> float:
    """The mean over prompts of r[path[0]][path[1]]..."""
    total = 0.0
    for r in report:
        for key in path:
            r = r[key]
        total += r  # type: ignore[operator]
    return total / len(report)


def print_tables(report: list[dict], spec, lm, seconds: float) -> None:
    lengths, depths = spec.task.get("context_lengths", []), spec.task.get("depths", [])
    print(
        f"{lm.name}, {len(report)} NIAH prompts ({'/'.join(map(str, lengths))} tokens × depths "
        f"{'/'.join(map(str, depths))}), budget {spec.budget}, {seconds:.0f} s"
    )
    print("\naccumulated attention (all queries, all layers), share of the mass and mass per token ÷ haystack's:")
    print(f"{'region':<10}{'share':>8}{'per token':>11}")
    for region in report[0]["mass_share"]:
        print(
            f"{region:<10}{mean(report, 'mass_share', region):>8.3f}"
            f"{mean(report, 'mass_per_token_vs_haystack', region):>11.2f}"
        )
    print_selection(report)
    print("\nper prompt, needle kept by h2o (sum) / h2o (mean) / original / snapkv:")
    for r in report:
        kept = r["needle_kept"]
        print(
            f"  {r['example_id']:<34} "
            + " / ".join(f"{kept[k]:.2f}" for k in ("h2o (sum)", "h2o (mean)", "original", "snapkv"))
        )
    first = report[0]
    print(
        f"\n{first['example_id']}: kvbench h2o (per KV head, group sum) vs the original (per query head): "
        f"Jaccard overlap of kept positions {first['jaccard_h2o_vs_original']:.2f}"
    )


def print_selection(report: list[dict]) -> None:
    scored = "score" in report[0]
    print("\nselection at the budget (mean over prompts, layers, heads):")
    print(
        f"{'selection':<12}{'needle kept':>12}{'heavy in first 10 %':>21}"
        + ("" if not scored else f"{'exact':>8}{'partial':>9}")
    )
    for label in report[0]["needle_kept"]:
        line = (
            f"{label:<12}{mean(report, 'needle_kept', label):>12.3f}"
            f"{mean(report, 'heavy_in_first_tenth', label):>21.3f}"
        )
        if scored and label in report[0]["score"]:
            line += (
                f"{mean(report, 'score', label, 'score'):>8.2f}{mean(report, 'score', label, 'score_partial'):>9.2f}"
            )
        print(line)
    if scored:
        print(
            f"{'full':<12}{'':>33}{mean(report, 'score', 'full', 'score'):>8.2f}"
            f"{mean(report, 'score', 'full', 'score_partial'):>9.2f}"
        )
