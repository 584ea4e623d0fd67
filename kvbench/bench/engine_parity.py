"""Parity of a serving engine's uncompressed run with kvbench's full cache, on the same token ids.

    python -m kvbench.bench engine_parity engine=NAME [overrides]   # e.g. engine=llamacpp limit=3 dtype=float32

The engine's venv must be built (`make engine-<name>`): without it the run is refused in one line. The prompts are the
task's (default task=niah: 1K/2K/4K × depths 10/50/90 %, query-aware; `limit=N`: the first N), built by kvbench's own
task code. Per prompt: kvbench's Engine (full cache) and the engine's `full` option decode greedily from the same ids;
the table says "identical" or the first divergent step, with the cause measured there:
- `kvb_gap`: kvbench's logit of its own token minus its logit of the engine's token (how far kvbench was from
  choosing the engine's token), and `eng_m`: the engine's top-1 - top-2 logit margin at that step (where it reports
  them);
- `fa_off`: the engine's full run with flash attention off (what its attention-reading options run with) against its
  default, where the engine has a `flash_attn` knob;
- `f32kv`: the same engine run with an f32 K/V cache, where it has `type_k`/`type_v` knobs (llama.cpp): identical to
  kvbench there means the f16 cache rounding decided it; still divergent means the weights as the engine computes
  with them (quantized blocks, activations quantized for the dot products) against kvbench's dequantized conversion.
Then each eviction option (`grid.method`; default the kvbench methods the engine applies) at no compression
(budget 1.0 >= the prompt) against the engine's own `full`, token for token, and (`bench.bytes=false` skips it) each
option's cache bytes on the first prompt. Default dtype float32 (llama.cpp computes in f32). Run it under a lock on a
shared machine: `flock /tmp/kvbench-heavy.lock python -m kvbench.bench engine_parity engine=...`.
"""

from __future__ import annotations

import time

import torch

from kvbench import KvbenchError
from kvbench.bench.common import checked, header, load, options

OPTIONS = {"bytes": True}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first step where a and b differ over their common length (None: identical there)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def engine_of(spec):
    """The run's serving engine (refused in one line for engine=kvbench; its venv and options checked by the run's
    own entrance check)."""
    from kvbench.engines import ENGINES, listed

    if spec.engine_name not in ENGINES.names():
        raise KvbenchError(f"give the serving engine to compare: engine={' | engine='.join(listed())}")
    return ENGINES.get(spec.engine_name)()


def parity_row(lm, engine, serving_engine, ex, stop_ids: list[int]) -> tuple[dict, object]:
    """kvbench's full cache against the engine's `full` on one prompt: the row, and the engine's generation."""
    from kvbench.engines import EngineRequest
    from kvbench.methods import build_method
    from kvbench.model.attention import StatsRequest

    ids = ex.context_ids + ex.question_ids
    start = time.perf_counter()
    ours = engine.generate(
        engine.prefill(ids, StatsRequest()), build_method("full"), None, [], ex.max_new_tokens, keep_logits=True
    )
    kv_s = time.perf_counter() - start
    theirs = serving_engine.generate(EngineRequest(ids, ex.max_new_tokens, "full", stop_ids=stop_ids))
    step = first_divergence(ours.token_ids, theirs.token_ids)
    row = {
        "prompt": f"{len(ids)} tok d={ex.meta.get('depth', '')}",
        "kvbench": lm.tokenizer.decode(ours.token_ids, skip_special_tokens=True).strip()[:18],
        "engine": lm.tokenizer.decode(theirs.token_ids, skip_special_tokens=True).strip()[:18],
        "parity": "identical" if step is None else f"step {step}",
        **dict.fromkeys(("kvb_gap", "eng_m", "f32kv", "fa_off"), ""),
        "kvb_s": f"{kv_s:.1f}",
        "eng_s": f"{theirs.prefill_s + theirs.decode_s:.1f}",
    }
    if step is None and len(ours.token_ids) != len(theirs.token_ids):
        row["parity"] = f"identical for {min(len(ours.token_ids), len(theirs.token_ids))} (lengths differ)"
    if step is not None:
        logits = ours.logits[step].float()  # (V,) kvbench's logits at the divergent step
        row["kvb_gap"] = f"{float(logits[ours.token_ids[step]] - logits[theirs.token_ids[step]]):.3f}"
        margins = theirs.extra.get("top2_margins") or []
        row["eng_m"] = f"{margins[step]:.3f}" if step < len(margins) else ""
        if "type_k" in serving_engine.options.get("full", {}):  # an f32 cache probe, where the engine has the knob
            probe = EngineRequest(ids, ex.max_new_tokens, "full", {"type_k": "f32", "type_v": "f32"}, None, stop_ids)
            probe_step = first_divergence(ours.token_ids, serving_engine.generate(probe).token_ids)
            row["f32kv"] = "identical" if probe_step is None else f"step {probe_step}"
    return row, theirs


def no_compression(serving_engine, ex, theirs, row: dict, opts: list[str], stop_ids: list[int]) -> list[tuple]:
    """Each eviction option at budget 1.0 against the engine's full run with the same flash-attention setting."""
    from kvbench.engines import EngineRequest

    ids, out = ex.context_ids + ex.question_ids, []
    references = {"auto": theirs.token_ids}  # the engine's full run per flash-attention setting
    for option in opts:
        knobs = serving_engine.knobs(option) if hasattr(serving_engine, "knobs") else {}
        flash = knobs.get("flash_attn", "auto")  # an option that reads attention runs without flash attention
        if flash not in references:
            request = EngineRequest(ids, ex.max_new_tokens, "full", {"flash_attn": flash}, None, stop_ids)
            references[flash] = serving_engine.generate(request).token_ids
        other = serving_engine.generate(EngineRequest(ids, ex.max_new_tokens, option, budget=1.0, stop_ids=stop_ids))
        same = other.token_ids == references[flash]
        verdict = "identical" if same else f"differs: {other.token_ids}"
        out.append((row["prompt"], f"{option} (vs full flash_attn={flash})", verdict))
    if "off" in references:
        step = first_divergence(references["off"], theirs.token_ids)
        row["fa_off"] = "identical" if step is None else f"step {step}"
    return out


def bytes_rows(lm, serving_engine, ex, stop_ids: list[int]) -> list[str]:
    """Each option of the engine on one prompt: what it holds per token."""
    from kvbench.engines import EngineRequest

    ids, out = ex.context_ids + ex.question_ids, []
    for option, knobs in serving_engine.options.items():
        g = serving_engine.generate(EngineRequest(ids, ex.max_new_tokens, option, stop_ids=stop_ids))
        fed = len(ids) + g.decode_steps
        found = ex.answers[0] in lm.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        kv = f"{knobs.get('type_k', '')}/{knobs.get('type_v', '')} fa={knobs.get('flash_attn', '')}"
        ratio, per_token = g.kv_bytes / g.kv_bytes_full, g.kv_bytes / fed
        out.append(
            f"| {option} | {kv} | {fed} | {g.kv_bytes:,} | {per_token:,.0f} | {ratio:.4f} "
            f"| {'yes' if found else 'no'} | {g.peak_mem_bytes / 2**20:.0f} |"
        )
    return out


def summary(serving_engine, lm, rows: list[dict], checks: list[tuple], sizes: list[str], first) -> None:
    name, version = serving_engine.label or serving_engine.name, serving_engine.info.get("engine_version")
    print(f"\n{name} ({version}) vs kvbench Engine full cache ({len(rows)} prompts)\n")
    head = list(rows[0])
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in head) + " |")
    print(f"\n{sum(r['parity'] == 'identical' for r in rows)}/{len(rows)} identical to kvbench's full cache")
    if checks:
        print("\nno compression (budget 1.0) vs the engine's full:")
        for prompt, option, verdict in checks:
            print(f"  {prompt:>16}  {option:<38} {verdict}")
        print(f"{sum(v == 'identical' for _, _, v in checks)}/{len(checks)} identical")
    if sizes:
        print(f"\ncache bytes the engine holds, first prompt ({first.n_tokens} tokens), {lm.name}:\n")
        print("| option | K/V | tokens | kv_bytes | bytes/token | kv_ratio | needle | peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|\n" + "\n".join(sizes))


def main(overrides: list[str]) -> None:
    from kvbench.native.engine import Engine
    from kvbench.tasks import build_task

    opts, overrides = options(overrides, OPTIONS, "engine_parity")
    spec, _ = checked(overrides, "method=full", "dtype=float32", "device=cpu")  # the venv, the options: one line
    serving_engine = engine_of(spec)
    entries = spec.grid.get("method")
    evict = [e["name"] if isinstance(e, dict) else e for e in entries] if entries else list(serving_engine.applies)
    evict = [o for o in evict if o != "full"]
    lm = load(spec)
    engine = Engine(lm)
    examples = build_task(spec.task, lm.tokenizer, spec.seed, lm.max_context).examples()[: spec.limit]
    header("engine_parity", lm, f"engine={spec.engine_name}")
    serving_engine.start(spec.model, spec.dtype if spec.dtype != "auto" else str(lm.dtype).removeprefix("torch."))
    stop_ids: list[int] = sorted(engine.eos_ids)  # type: ignore[arg-type]  # token ids
    rows: list[dict] = []
    checks: list[tuple] = []
    sizes: list[str] = []
    try:
        with torch.no_grad():
            for ex in examples:
                row, theirs = parity_row(lm, engine, serving_engine, ex, stop_ids)
                checks += no_compression(serving_engine, ex, theirs, row, evict, stop_ids)
                rows.append(row)
                print(" | ".join(str(v) for v in row.values()), flush=True)
            sizes = bytes_rows(lm, serving_engine, examples[0], stop_ids) if opts["bytes"] else []
    finally:
        serving_engine.close()
    summary(serving_engine, lm, rows, checks, sizes, examples[0])
