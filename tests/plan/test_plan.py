"""`python -m kvbench.plan`: the contract (plan.csv columns), the seed's worked example, fits and the roofline."""

import json
import sys

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from kvbench.methods import build_method
from kvbench.plan.hardware import GIB, Hardware, build_hardware, calibrated_cpu
from kvbench.plan.model import arch_of, plan_point
from kvbench.plan.planner import PLAN_COLUMNS, run_plan
from tests.conftest import CONF_DIR

# the seed's "32B model" (#307): 40 layers, 8 KV heads, head_dim 128 (Qwen2.5-32B's shape otherwise)
SEED_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def plan_config(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("plan", overrides=["plot=false", *overrides])


@pytest.fixture
def seed_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SEED_CONFIG))
    return f"model.name_or_path={path}"


def test_seed_worked_example_through_the_planner(tmp_path, seed_model, capsys):
    cfg = plan_config(
        "model=hub", seed_model, "hardware=h200", "dtype=float16", "context=[32768,131072]", "batch=[1,8]"
    )
    frame = run_plan(cfg, tmp_path)
    on_disk = pd.read_csv(tmp_path / "plan.csv")
    assert list(on_disk.columns[: len(PLAN_COLUMNS)]) == PLAN_COLUMNS
    rows = on_disk.set_index(["context", "batch"])
    assert rows.loc[(32768, 1), "kv_bytes"] == 5_368_709_120  # ≈ 5.4 GB
    assert rows.loc[(131072, 1), "kv_bytes"] == 21_474_836_480  # ≈ 21.5 GB
    assert round(rows.loc[(131072, 8), "kv_bytes"] / 1e9) == 172
    assert not rows.loc[(131072, 8), "fits"] and rows.loc[(131072, 8), "decode_bound"] == "oom"  # "exceeds HBM"
    assert rows.loc[(32768, 1), "fits"] and rows.loc[(32768, 1), "decode_bound"] == "bandwidth"
    assert (frame.method == "full").all()
    assert "40 global layers × 2048 (K+V) × 2 B = 163,840 B" in capsys.readouterr().out


def test_limits_are_the_boundary_of_fits(tiny):
    cfg = plan_config("model=tiny-random")
    arch = arch_of(cfg.model)
    assert arch.n_params == sum(p.numel() for p in tiny.model.parameters())  # meta-device count = the real model
    hw = Hardware("toy", 8 << 20, 1e9, 1e12, "test")  # 8 MiB: a few thousand tokens of the tiny model
    for name, budget in [("full", None), ("snapkv", 0.25)]:
        method = build_method(name)
        from kvbench.methods import Budget

        b = Budget.parse(budget) if budget else None
        point = plan_point(arch, hw, method, b, torch.float32, 2048, 1, 0.1)
        assert plan_point(arch, hw, method, b, torch.float32, 2048, point["max_batch"], 0.1)["fits"]
        assert not plan_point(arch, hw, method, b, torch.float32, 2048, point["max_batch"] + 1, 0.1)["fits"]
        longest = point["max_context"]
        assert plan_point(arch, hw, method, b, torch.float32, longest, 1, 0.1)["fits"]
        if longest < arch.max_context:  # memory bounds it
            assert not plan_point(arch, hw, method, b, torch.float32, longest + 1, 1, 0.1)["fits"]
        else:  # the model's own position limit bounds it, not the search cap
            assert longest == arch.max_context


def test_roofline_terms(tiny):
    arch = arch_of(plan_config("model=tiny-random").model)
    hw = Hardware("toy", 1 << 40, 1e9, 1e9, "test")  # ridge at 1 FLOP/byte
    one = plan_point(arch, hw, build_method("full"), None, torch.float32, 1000, 1, 0.0)
    kv = 2 * 4 * 2 * 16 * 1000 * 4
    assert one["kv_bytes"] == kv and one["weights_bytes"] == 4 * arch.n_params
    flops = 2 * arch.matmul_params + 4 * 4 * 16 * 4 * 1000  # weights + QKᵀ/AV over 4 layers × 1000 tokens
    assert one["decode_flops"] == flops
    assert one["decode_s_bound"] == max((kv + one["weights_bytes"]) / 1e9, flops / 1e9)
    # at batch 1 decode reads every byte for ~1-2 FLOPs: bandwidth-bound; a large batch crosses the ridge
    assert one["decode_bound"] == "bandwidth"
    wide = plan_point(arch, hw, build_method("full"), None, torch.float32, 16, 4096, 0.0)
    assert wide["arithmetic_intensity"] > 1 and wide["decode_bound"] == "compute"


def test_presets_load_and_cpu_calibration_is_cached(tmp_path, monkeypatch):
    for name in ["h200", "h100-sxm", "a100-80gb", "l40s", "rtx4090"]:
        hw = build_hardware(plan_config(f"hardware={name}").hardware)
        assert hw.memory_bytes >= 24 * GIB and hw.bandwidth_bytes_s > 5e11 and hw.peak_flops > 1e14
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    calls = []
    fake = {"memory_bytes": 1 << 34, "bandwidth_bytes_s": 2e10, "peak_flops": 1e12, "threads": 2}
    monkeypatch.setattr("kvbench.plan.hardware.measure_cpu", lambda **size: calls.append(1) or fake)
    first, second = calibrated_cpu(), calibrated_cpu()
    assert len(calls) == 1 and first == second and (tmp_path / "hardware-cpu.json").exists()
    hw = build_hardware(plan_config("hardware=cpu").hardware)
    assert hw.bandwidth_bytes_s == 2e10 and hw.source.startswith("measured")


@pytest.mark.parametrize(
    "flags,n,says",
    [
        ({"avx2", "avx512_bf16"}, 2048, "about 2 s (2048² bf16 matmuls, native; estimated from a small one)"),
        ({"avx2", "fma"}, 512, "about 2 s (512² bf16 matmuls, emulated: no AVX512-BF16/AMX; estimated from a small"),
    ],
)
def test_calibration_says_how_long_it_will_take(tmp_path, monkeypatch, capsys, flags, n, says):
    """The line gives the estimate before measuring. An AVX2-only CPU emulates bf16, ~10x slower still once the
    matrices leave the cache (2048²: 9 minutes): it measures at 512², seconds."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr("kvbench.model.device.cpu_flags", lambda: flags)
    sizes = []
    monkeypatch.setattr("kvbench.plan.hardware.calibration_seconds", lambda matmul_n: sizes.append(matmul_n) or 2.4)
    fake = {"memory_bytes": 1 << 34, "bandwidth_bytes_s": 2e10, "peak_flops": 1e12, "threads": 2}
    monkeypatch.setattr("kvbench.plan.hardware.measure_cpu", lambda matmul_n: sizes.append(matmul_n) or fake)
    calibrated_cpu()
    assert says in capsys.readouterr().out and sizes == [n, n]


def test_calibration_estimate_scales_a_quick_probe():
    from kvbench.plan.hardware import calibration_seconds

    small, large = calibration_seconds(16, 512, 1), calibration_seconds(16, 4096, 1)
    assert 0 < small < large  # 512× the matmul work: longer, whatever the CPU


def test_measure_cpu_gives_positive_rates():
    from kvbench.plan.hardware import measure_cpu

    measured = measure_cpu(copy_mib=16, matmul_n=256, repeats=1)
    assert measured["bandwidth_bytes_s"] > 1e8 and measured["peak_flops"] > 1e8 and measured["memory_bytes"] > 1 << 28


def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from kvbench.plan.planner import _main

    monkeypatch.setattr(
        sys, "argv", ["kvbench.plan", "model=tiny-random", "context=abc", "plot=false", f"hydra.run.dir={tmp_path}"]
    )
    with pytest.raises(SystemExit) as exit_info:
        _main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvbench.plan: error: context=abc is not a number; use context=4096 or 'context=[4096,32768]' (tokens per "
        "request)"
    ]
    assert not (tmp_path / "plan.csv").exists()


def test_region_plot_written(tmp_path):
    run_plan(
        plan_config("model=tiny-random", "plot=true", "hardware=rtx4090", "method=snapkv", "budget=0.25"), tmp_path
    )
    assert (tmp_path / "plan_regions.png").stat().st_size > 10_000
