"""`python -m kvbench.plan [overrides]`: will it fit, and how fast can it decode? (no model run, seconds)

For a model (any conf/model/*, a hub id or a local config.json), a hardware preset (conf/hardware/*), contexts ×
batches and the configurations a run would use (the full cache + `method`/`budget`, or `grid.method × grid.budget`):
KV bytes per token by the seed's formula and after compression (kvbench.model.kv_bytes: the accounting the engine
measures), weights, total vs usable device memory → fits, the largest batch / context that fit, and the decode
roofline (kvbench.plan.model). Writes plan.csv, plan.json, plan_limits.csv and plan_regions.png to its run directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import pandas as pd
from omegaconf import DictConfig

from kvbench import KvbenchError, conf_dir

PLAN_COLUMNS = [
    "model",
    "hardware",
    "method",
    "variant",
    "budget",
    "dtype",
    "context",
    "batch",
    "kv_bytes",
    "kv_bytes_full",
    "kv_ratio",
    "weights_bytes",
    "total_bytes",
    "device_bytes",
    "fits",
    "max_batch",
    "decode_bound",
    "decode_s_bound",
]
LIMIT_BATCHES = (1, 8, 32, 128)


def plan(cfg: DictConfig) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(plan rows, limits rows, header) for the configured model, hardware, configurations, contexts, batches."""
    from kvbench.config.spec import RunSpec
    from kvbench.model.load import resolve_dtype
    from kvbench.plan.hardware import build_hardware
    from kvbench.plan.inputs import check_contexts, check_options, check_plan, kv_bits, listed
    from kvbench.plan.model import Options, arch_of, plan_point
    from kvbench.plan.reuse import Reuse, workload_shape
    from kvbench.rows.configuration import configurations
    from kvbench.store.aggregate import variant_label

    config = check_plan(cfg)  # every key, the hardware, method, grid and model shape: before any arithmetic
    contexts, batches = (list(map(int, listed(config[key]))) for key in ("context", "batch"))
    headroom = float(config["headroom"])
    measured = workload_shape(cfg.reuse_from) if cfg.get("reuse_from") else None
    if measured is not None:  # the measured workload's shape replaces context, batch, prefix and reuse
        contexts, batches = [measured.context], [measured.batch]
        reuse = Reuse(measured.prefix, measured.mode, int(cfg.get("page_size") or 16))
    else:
        reuse = Reuse.from_cfg(cfg, contexts)
    dtype = resolve_dtype(cfg.dtype)
    hw = build_hardware(cfg.hardware)
    arch = arch_of(cfg.model)
    check_contexts(contexts, arch, bool(config.get("extrapolate")))
    confs = configurations(RunSpec.of(cfg))
    check_options(config, confs, arch)
    options = Options(kv_bits(config.get("kv_dtype")), config.get("prefill") or "shared", config.get("prefill_chunk"))
    rows, limits = [], []
    for c in confs:
        label = variant_label(c.method.name, c.method.params())
        common = {
            "model": arch.name,
            "hardware": hw.name,
            "method": c.method.name,
            "variant": label,
            "budget": c.budget_value,
            "dtype": str(dtype).removeprefix("torch."),
            "kv_dtype": str(config.get("kv_dtype") or str(dtype).removeprefix("torch.")),
            "weights_quant": arch.quant_method or "none",
            "prefill": options.prefill,
            "prefill_chunk": options.prefill_chunk,
        }

        def point_at(context: int, batch: int, c=c) -> dict:
            return plan_point(
                arch, hw, c.method, c.budget, dtype, context, batch, headroom, reuse=reuse, options=options
            )

        for context in contexts:
            for batch in batches:
                rows.append({**common, **point_at(context, batch)})
        for batch in sorted(set(batches) | set(LIMIT_BATCHES)):
            point = point_at(contexts[0], batch)
            limits.append(
                {"variant": label, "budget": c.budget_value, "batch": batch, "max_context": point["max_context"]}
            )
        for context in contexts:
            point = point_at(context, 1)
            limits.append(
                {"variant": label, "budget": c.budget_value, "context": context, "max_batch": point["max_batch"]}
            )
    header = {
        "model": {k: v for k, v in arch.__dict__.items() if k != "config"},
        "hardware": hw.__dict__,
        "headroom": headroom,
        "dtype": str(dtype),
        "kv_bytes_per_token": per_layer_type_formula(arch.layout(dtype), options.kv_bits),
        "weights_bytes": arch.weights_bytes(dtype),
        "weights_quant": (
            f"{arch.quant_method}: {arch.quantized_params / 1e9:.2f} B of {arch.n_params / 1e9:.2f} B params at "
            f"{arch.quant_bits:.4g} bits"
            if arch.quant_method
            else None
        ),
        "prefill": options.prefill + (f", chunks of {options.prefill_chunk}" if options.prefill_chunk else ""),
        "reuse": {"prefix": reuse.prefix, "mode": reuse.label, "page_size": reuse.page_size},
        "reuse_from": measured.describe() if measured else None,
    }
    frame = pd.DataFrame(rows)
    frame = frame[PLAN_COLUMNS + [c for c in frame.columns if c not in PLAN_COLUMNS]]
    return frame, pd.DataFrame(limits), header


def _gb(n) -> str:
    return f"{n / 1e9:,.2f}"


def print_plan(frame: pd.DataFrame, limits: pd.DataFrame, header: dict, out_dir: Path) -> None:
    from kvbench.plan.hardware import GIB, Hardware, describe

    hw = Hardware(**header["hardware"])
    print(
        f"model:    {header['model']['name']}: {header['model']['n_params'] / 1e9:.2f} B params, weights "
        f"{_gb(header['weights_bytes'])} GB ({header.get('weights_quant') or header['dtype'].removeprefix('torch.')})"
    )
    print(f"KV/token: {header['kv_bytes_per_token']} (uncompressed)")
    print(f"hardware: {describe(hw)}")
    if header.get("reuse_from"):
        print(f"measured: {header['reuse_from']}")
    if header["reuse"]["prefix"]:
        r = header["reuse"]
        print(
            f"reuse:    every request's first {r['prefix']} tokens shared by the batch, prefix caching {r['mode']} "
            f"(page_size {r['page_size']}): held once, prefilled once (kvbench/plan/reuse.py)"
        )
    print(
        f"fits:     weights + KV + the prefill's peak (prefill={header['prefill']}) ≤ device × (1 − headroom "
        f"{header['headroom']}) = "
        f"{hw.memory_bytes * (1 - header['headroom']) / GIB:.1f} GiB (headroom: activations, runtime, fragmentation)"
    )
    table = pd.DataFrame(
        {
            "variant": frame.variant,
            "budget": frame.budget,
            "context": frame.context,
            "batch": frame.batch,
            "kv_GB": frame.kv_bytes.map(_gb),
            "ratio": frame.kv_ratio.map(lambda v: f"{v:.3f}"),
            "prefill_GB": frame.prefill_peak_bytes.map(_gb),
            "total_GB": frame.total_bytes.map(_gb),
            "fits": frame.fits,
            "max_batch": frame.max_batch,
            "AI": frame.arithmetic_intensity.map(lambda v: f"{v:.1f}"),
            "bound": frame.decode_bound,
            "decode_ms": (1000 * frame.decode_s_bound).map(lambda v: f"{v:.3f}"),
            "tok/s": frame.decode_tokens_per_s_bound.map(lambda v: f"{v:,.0f}"),
            "prefill_s": frame.prefill_s_bound.map(lambda v: f"{v:.3f}"),
        }
    )
    reuse = header["reuse"]
    if reuse["prefix"]:  # requests sharing a prefix: what is held once, and the prefill it saves
        table.insert(5, "shared_GB", frame.kv_bytes_shared.map(_gb))
        table["saved_s"] = frame.prefill_s_saved.map(lambda v: f"{v:.3f}")
    print()
    print(table.to_string(index=False))
    wide = limits.dropna(subset=["batch"]).pivot_table(
        index=["variant", "budget"], columns="batch", values="max_context", sort=False
    )
    wide.columns = [f"max_ctx@B={int(b)}" for b in wide.columns]
    print("\nlargest context that fits, per batch size:")
    print(wide.astype(int).to_string())
    print(
        f"\nplan:    {out_dir / 'plan.csv'}\nlimits:  {out_dir / 'plan_limits.csv'}\njson:    {out_dir / 'plan.json'}"
    )


def run_plan(cfg: DictConfig, out_dir: Path) -> pd.DataFrame:
    from kvbench.plan.model import write_json
    from kvbench.store.results import check_writable, write_csv

    frame, limits, header = plan(cfg)
    check_writable(out_dir)
    write_csv(frame, out_dir / "plan.csv")
    write_csv(limits, out_dir / "plan_limits.csv")
    write_json(out_dir / "plan.json", {**header, "rows": frame.to_dict("records"), "limits": limits.to_dict("records")})
    print_plan(frame, limits, header, out_dir)
    if cfg.get("plot", True):
        from kvbench.plan.plots import region_plot

        path = region_plot(cfg, out_dir / "plan_regions.png")
        print(f"plot:    {path}")
    return frame


@hydra.main(config_path=str(conf_dir()), config_name="plan", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        run_plan(cfg, Path(HydraConfig.get().runtime.output_dir))
    except KvbenchError as error:
        print(f"kvbench.plan: error: {error}", file=sys.stderr)
        sys.exit(2)


def per_layer_type_formula(layout, kv_bits: int | None = None) -> str:
    """The full cache per token, by layer kind: `L_kind × width × bytes` summed; sliding layers stop at W − 1 tokens,
    layers reusing another layer's K/V hold none; with `kv_bits`, elements are stored at that many bits."""
    from collections import Counter

    eb = layout.element_bytes
    size = f"{eb} B" if kv_bits is None else f"{kv_bits} bits"
    groups = Counter((k.kind, k.width, k.window) for k in layout.layers)
    parts = []
    for (kind, width, window), count in groups.items():
        held = f" for the last {window - 1} tokens" if kind == "sliding" else ""
        total = count * width * eb if kv_bits is None else -(-count * width * kv_bits // 8)
        what = "(K+V+indexer key)" if kind == "latent" and any(k.extra_width for k in layout.layers) else "(K+V)"
        parts.append(f"{count} {kind} layers × {width} {what} × {size} = {total:,} B{held}")
    if layout.states:  # a hybrid's linear/Mamba/conv layers: per request, whatever the context or method
        parts.append(f"+ {len(layout.states)} state layers: {layout.state_bytes():,} B per request, constant")
    return "; ".join(parts)
