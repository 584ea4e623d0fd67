"""The planner's reuse factor (kvbench.plan.reuse): requests sharing a prefix, counted once across the batch, with
exact numbers on the tiny model's shape (fp32: 2 · 4 layers · 2 KV heads · 16 · 4 B = 1,024 B per token), and
against what the engine holds in a workload run."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.model.kv_bytes import KVShape
from kvbench.plan.hardware import Hardware
from kvbench.plan.model import arch_of, plan_point
from kvbench.plan.planner import run_plan
from kvbench.plan.reuse import Reuse, held_bytes, prefill_flops
from kvbench.run.runner import run
from tests.conftest import CONF_DIR, compose_config

SHAPE = KVShape(4, 2, 16, torch.float32)
HW = Hardware("toy", 1 << 40, 1e9, 1e12, "test")


def plan_config(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("plan", overrides=["plot=false", "model=tiny-random", "dtype=float32", *overrides])


@pytest.fixture(scope="module")
def arch():
    return arch_of(plan_config().model)


def point(arch, name, budget, reuse, batch=8, context=1000):
    b = Budget.parse(budget) if budget else None
    return plan_point(arch, HW, build_method(name), b, torch.float32, context, batch, 0.0, reuse=reuse)


def test_full_cache_holds_the_shared_pages_once(arch):
    p = point(arch, "full", None, Reuse(prefix=900))
    # 900 shared tokens → 56 whole pages of 16 = 896 tokens held once; each request: its other 104 tokens
    assert (p["prefix_tokens"], p["kv_bytes_shared"], p["kv_bytes_private"]) == (896, 917_504, 106_496)
    assert p["kv_bytes"] == 917_504 + 8 * 106_496 == 1_769_472
    assert p["kv_bytes_full"] == 8 * 1000 * 1024 and p["kv_ratio"] == pytest.approx(1_769_472 / 8_192_000)
    assert p["kv_bytes_per_request"] == 1000 * 1024  # decode reads each request's whole view
    assert p["decode_bytes"] == p["weights_bytes"] + 8 * 1_024_000
    # later requests reuse the 896 tokens: 7 × the prefill of tokens [0, 896) saved
    f = 2 * arch.matmul_params * 896 + 2 * 4 * 16 * 4 * 896**2
    assert prefill_flops(arch, 0, 896) == f and p["prefill_flops_saved"] == 7 * f
    assert p["prefill_flops"] == 8 * prefill_flops(arch, 0, 1000) - 7 * f
    plain = point(arch, "full", None, Reuse())
    assert plain["kv_bytes"] == 8_192_000 and plain["prefill_flops_saved"] == 0 and plain["reuse"] == "none"


def test_compressing_per_question_keeps_pages_beside_each_compressed_cache(arch):
    p = point(arch, "snapkv", 0.25, Reuse(prefix=900))
    # each request: 250 tokens per layer compressed (256,000 B) + its further whole pages 896..992 (98,304 B)
    assert p["kv_bytes_private"] == 256_000 + 96 * 1024 == 354_304
    assert p["kv_bytes"] == 917_504 + 8 * 354_304 == 3_751_936
    assert p["kv_bytes"] > point(arch, "snapkv", 0.25, Reuse())["kv_bytes"] == 8 * 256_000  # sharing vs compressing
    # SnapKV's 32-token window stays with the request (cap 968 → 960 in pages): the 896 shared tokens are reused
    assert p["prefill_flops_saved"] == 7 * prefill_flops(arch, 0, 896)
    # H2O sums every query's attention: nothing is reused, nothing saved
    assert point(arch, "h2o", 0.25, Reuse(prefix=900))["prefill_flops_saved"] == 0


def test_compress_once_holds_the_compressed_prefix_once(arch):
    p = point(arch, "snapkv", 0.25, Reuse(prefix=900, mode="compress_once"))
    # the 900-token prefix compressed once (225 tokens per layer), each request's 100 further tokens dense
    assert (p["prefix_tokens"], p["kv_bytes_shared"], p["kv_bytes_private"]) == (900, 230_400, 102_400)
    assert p["kv_bytes"] == 230_400 + 8 * 102_400 == 1_049_600 and p["reuse"] == "compress_once"
    assert p["prefill_flops_saved"] == 7 * prefill_flops(arch, 0, 900)


def test_max_batch_and_fits_count_the_shared_part_once(arch):
    reuse = Reuse(prefix=900)
    weights = point(arch, "full", None, reuse)["weights_bytes"]
    hw = Hardware("small", weights + 917_504 + 10 * 106_496, 1e9, 1e12, "test")  # room for exactly 10 requests
    b = None
    at = plan_point(arch, hw, build_method("full"), b, torch.float32, 1000, 1, 0.0, reuse=reuse)
    assert at["max_batch"] == 10
    assert plan_point(arch, hw, build_method("full"), b, torch.float32, 1000, 10, 0.0, reuse=reuse)["fits"]
    assert not plan_point(arch, hw, build_method("full"), b, torch.float32, 1000, 11, 0.0, reuse=reuse)["fits"]
    longest = plan_point(arch, hw, build_method("full"), b, torch.float32, 1000, 10, 0.0, reuse=reuse)["max_context"]
    assert longest == 1000  # 10 requests: 896 shared + 10 × 104 own tokens fill it exactly


def test_plan_csv_has_the_reuse_columns_and_bad_input_names_the_fix(tmp_path):
    cfg = plan_config(
        "context=1000", "batch=[1,8]", "prefix=900", "reuse=compress_once", "method=snapkv", "budget=0.25"
    )
    run_plan(cfg, tmp_path)
    rows = pd.read_csv(tmp_path / "plan.csv").set_index(["method", "batch"])
    assert rows.loc[("snapkv", 8), "kv_bytes"] == 1_049_600 and rows.loc[("snapkv", 8), "prefix_tokens"] == 900
    assert rows.loc[("full", 1), "reuse"] == "compress_once"
    with pytest.raises(KvbenchError, match="prefix=2000 is longer than context=1000"):
        run_plan(plan_config("context=1000", "prefix=2000"), tmp_path)
    with pytest.raises(
        KvbenchError,
        match="reuse=once is not one of per_question, compress_once; use reuse=per_question or reuse=compress_once",
    ):
        run_plan(plan_config("context=1000", "prefix=10", "reuse=once"), tmp_path)


@pytest.mark.parametrize(
    "method, reuse", [("full", "per_question"), ("snapkv", "per_question"), ("snapkv", "compress_once")]
)
def test_planner_bytes_equal_what_a_workload_holds(tmp_path, tiny, method, reuse):
    """A shared_doc workload on the tiny model (1 new token: nothing decoded into the cache): the bytes held after
    its last request (the store once + every request's own cache) equal the planner's once + Σ private."""
    from omegaconf import OmegaConf

    from kvbench.tasks import build_task

    overrides = ["task=shared_doc", "task.questions=3", "task.context_length=400", "task.max_new_tokens=1"]
    rows = run(
        compose_config(
            "model=tiny-random",
            "device=cpu",
            "dtype=float32",
            f"results_dir={tmp_path / 'store'}",
            "report=false",
            *overrides,
            f"method={method}",
            "budget=0.5",
            "prefix_cache=true",
            f"reuse={reuse}",
        ),
        output_dir=tmp_path / "run",
    )
    rows = rows[rows.method == method].sort_values("request_index")
    task_cfg = OmegaConf.merge(
        OmegaConf.load(CONF_DIR / "task" / "shared_doc.yaml"),
        {"questions": 3, "context_length": 400, "max_new_tokens": 1},
    )
    examples = build_task(task_cfg, tiny.tokenizer, 0).examples()
    prompts = [ex.context_ids + ex.question_ids for ex in examples]
    common = next(i for i in range(len(prompts[0])) if len({tuple(p[: i + 1]) for p in prompts}) > 1)
    plan_reuse = Reuse(prefix=400 if reuse == "compress_once" else common, mode=reuse)
    b = Budget.parse(0.5) if method != "full" else None
    held = [held_bytes(build_method(method), b, SHAPE, len(p), plan_reuse) for p in prompts]
    assert rows.held_bytes.iloc[-1] == held[0].once + sum(h.private for h in held)


def test_reuse_from_reads_the_workload_shape_from_rows(tmp_path):
    overrides = ["task=shared_doc", "task.questions=3", "task.context_length=400", "task.max_new_tokens=1"]
    base = ["model=tiny-random", "device=cpu", "dtype=float32", f"results_dir={tmp_path / 'store'}", "report=false"]
    rows = run(
        compose_config(*base, *overrides, "method=snapkv", "budget=0.5", "prefix_cache=true", "reuse=compress_once"),
        output_dir=tmp_path / "run",
    )
    prompts = sorted(set(rows.prefill_tokens + rows.reused_tokens))
    plan = run_plan(plan_config(f"reuse_from={tmp_path / 'run'}", "method=snapkv", "budget=0.5"), tmp_path / "plan")
    # 3 requests, the median prompt, the 400-token context compressed once
    assert set(plan.batch) == {3} and set(plan.context) == {prompts[1]} and set(plan.prefix_tokens) == {400}
    assert set(plan.reuse) == {"compress_once"}
    snap = plan[plan.method == "snapkv"].iloc[0]
    assert snap.kv_bytes_shared == 200 * 1024 and snap.kv_bytes_private == (prompts[1] - 400) * 1024
    run(compose_config(*base, *overrides, "method=full"), output_dir=tmp_path / "plain")  # no prefix cache
    with pytest.raises(KvbenchError, match="holds no rows of a workload run with prefix_cache=true"):
        run_plan(plan_config(f"reuse_from={tmp_path / 'plain'}"), tmp_path / "plan2")
    with pytest.raises(KvbenchError, match="does not exist"):
        run_plan(plan_config(f"reuse_from={tmp_path / 'nowhere'}"), tmp_path / "plan3")
