"""Parity of a serving engine's uncompressed run with kvbench's full cache, on the same token ids.

    python scripts/engine_parity.py --engine llamacpp [--model smollm2-135m] [--dtype float32] [--limit N]
                                    [--options streamingllm snapkv]

The prompts are the default task's (task=niah: 1K/2K/4K x depths 10/50/90 %, query-aware), built by kvbench's own
task code. Per prompt: kvbench's Engine (full cache) and the engine's `full` option decode greedily from the same
ids; the table says "identical" or the first divergent step, with the cause measured there:
- `kvb_gap`: kvbench's logit of its own token minus its logit of the engine's token (how far kvbench was from
  choosing the engine's token), and `eng_m`: the engine's top-1 - top-2 logit margin at that step;
- `fa_off`: the engine's full run with flash attention off (what snapkv runs with) against its default;
- `f32kv`: the same engine run with an f32 K/V cache (llama.cpp): identical to kvbench there means the f16 cache
  rounding decided it; still divergent means the weights as the engine computes with them (the Q4_1/Q4_K blocks,
  with activations quantized to Q8 for the dot products) against kvbench's dequantized fp32 conversion.
Then each eviction option at no compression (budget 1.0 >= the prompt) against the engine's own `full`, token for
token. Run it under the lock: `flock /tmp/kvbench-heavy.lock python scripts/engine_parity.py --engine llamacpp`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from omegaconf import OmegaConf

from kvbench import conf_dir
from kvbench.backends import BACKENDS, EngineRequest
from kvbench.engine.engine import Engine
from kvbench.methods import METHODS
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model
from kvbench.tasks.base import build_task


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first step where a and b differ over their common length (None: identical there)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="llamacpp")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", help="kvbench's dtype (llama.cpp computes in f32)")
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--options", nargs="*", default=None, help="eviction options checked at no compression")
    parser.add_argument("--no-bytes", action="store_true", help="skip the bytes-per-token table of the options")
    args = parser.parse_args()

    model_cfg = OmegaConf.load(conf_dir() / "model" / f"{args.model}.yaml")
    backend = BACKENDS.get(args.engine)(n_threads=int(os.environ.get("OMP_NUM_THREADS") or 1))
    options = list(backend.applies) if args.options is None else args.options
    for option in ["full", *options]:
        why = backend.unavailable(OmegaConf.to_container(model_cfg), option)
        if why:
            raise SystemExit(f"error: {why}")
    lm = load_model(model_cfg, "cpu", args.dtype)
    engine = Engine(lm)
    task_cfg = OmegaConf.load(conf_dir() / "task" / "niah.yaml")
    examples = build_task(task_cfg, lm.tokenizer, 0, lm.max_context).examples()[: args.limit]
    backend.start(OmegaConf.to_container(model_cfg), args.dtype)
    full = METHODS.get("full")()
    stop_ids = sorted(engine.eos_ids)
    rows, no_compression = [], []
    try:
        for ex in examples:
            ids = ex.context_ids + ex.question_ids
            t0 = time.perf_counter()
            prefill = engine.prefill(ids, StatsRequest())
            ours = engine.generate(prefill, full, None, [], ex.max_new_tokens, keep_logits=True)
            kv_s = time.perf_counter() - t0
            request = EngineRequest(ids, ex.max_new_tokens, "full", stop_ids=stop_ids)
            theirs = backend.generate(request)
            step = first_divergence(ours.token_ids, theirs.token_ids)
            row = {
                "prompt": f"{len(ids)} tok d={ex.meta.get('depth', '')}",
                "kvbench": lm.tokenizer.decode(ours.token_ids, skip_special_tokens=True).strip()[:18],
                "engine": lm.tokenizer.decode(theirs.token_ids, skip_special_tokens=True).strip()[:18],
                "parity": "identical" if step is None else f"step {step}",
                "kvb_gap": "",
                "eng_m": "",
                "f32kv": "",
                "fa_off": "",
                "kvb_s": f"{kv_s:.1f}",
                "eng_s": f"{theirs.prefill_s + theirs.decode_s:.1f}",
            }
            if step is None and len(ours.token_ids) != len(theirs.token_ids):
                row["parity"] = f"identical for {min(len(ours.token_ids), len(theirs.token_ids))} (lengths differ)"
            if step is not None:
                logits = ours.logits[step].float()  # (V,) kvbench's logits at the divergent step
                row["kvb_gap"] = f"{float(logits[ours.token_ids[step]] - logits[theirs.token_ids[step]]):.3f}"
                row["eng_m"] = f"{theirs.extra['top2_margins'][step]:.3f}"
                probe = backend.generate(
                    EngineRequest(ids, ex.max_new_tokens, "full", {"type_k": "f32", "type_v": "f32"}, None, stop_ids)
                )
                probe_step = first_divergence(ours.token_ids, probe.token_ids)
                row["f32kv"] = "identical" if probe_step is None else f"step {probe_step}"
            rows.append(row)
            references = {"auto": theirs.token_ids}  # the engine's full run per flash-attention setting
            for option in options:
                flash = backend.knobs(option)["flash_attn"]  # snapkv reads attention: flash attention off
                if flash not in references:
                    knobs = {"flash_attn": flash}
                    references[flash] = backend.generate(
                        EngineRequest(ids, ex.max_new_tokens, "full", knobs, None, stop_ids)
                    ).token_ids
                other = backend.generate(EngineRequest(ids, ex.max_new_tokens, option, budget=1.0, stop_ids=stop_ids))
                same = other.token_ids == references[flash]
                verdict = "identical" if same else f"differs: {other.token_ids}"
                no_compression.append((row["prompt"], f"{option} (vs full flash_attn={flash})", verdict))
            if "off" in references:
                step = first_divergence(references["off"], theirs.token_ids)
                row["fa_off"] = "identical" if step is None else f"step {step}"
            print(" | ".join(str(v) for v in row.values()), flush=True)
        bytes_rows = []
        if not args.no_bytes:  # each precision option on the first prompt: what llama.cpp holds per token
            ex = examples[0]
            ids = ex.context_ids + ex.question_ids
            for option, knobs in backend.options.items():
                g = backend.generate(EngineRequest(ids, ex.max_new_tokens, option, stop_ids=stop_ids))
                fed = len(ids) + g.decode_steps
                found = ex.answers[0] in lm.tokenizer.decode(g.token_ids, skip_special_tokens=True)
                bytes_rows.append(
                    f"| {option} | {knobs['type_k']}/{knobs['type_v']} fa={knobs['flash_attn']} | {fed} | "
                    f"{g.kv_bytes:,} | {g.kv_bytes / fed:,.0f} | {g.kv_bytes / g.kv_bytes_full:.4f} | "
                    f"{'yes' if found else 'no'} | {g.peak_mem_bytes / 2**20:.0f} |"
                )
    finally:
        backend.close()
    print(
        f"\n{args.engine} ({backend.info.get('engine_version')}) vs kvbench Engine full cache, {args.model} "
        f"{args.dtype}, task=niah defaults ({len(rows)} prompts)\n"
    )
    head = list(rows[0])
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in head) + " |")
    same = sum(r["parity"] == "identical" for r in rows)
    print(f"\n{same}/{len(rows)} identical to kvbench's full cache")
    if options:
        print(f"\nno compression (budget 1.0) vs {args.engine} full:")
        for prompt, option, verdict in no_compression:
            print(f"  {prompt:>16}  {option:<38} {verdict}")
        ok = sum(v == "identical" for _, _, v in no_compression)
        print(f"{ok}/{len(no_compression)} identical")
    if bytes_rows:
        print(f"\ncache bytes llama.cpp holds, first prompt ({examples[0].n_tokens} tokens), {args.model}:\n")
        print("| option | K/V | tokens | kv_bytes | bytes/token | kv_ratio | needle | peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(bytes_rows))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
