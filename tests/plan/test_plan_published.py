"""The planner on published models (configs in tests/fixtures, copied from each model's config.json on the hub):
weights from a checkpoint's quantization_config, KV caches stored in fewer bits than the compute dtype, the prefill's
peak in "fits", the run's refusal rules, and one line (never a traceback) for configs it cannot plan.

Published figures each test checks against:
- gpt-oss-120b (openai/gpt-oss-120b model card): 117B parameters, MoE weights in MXFP4, "fits into a single 80GB GPU";
- DeepSeek-V2 (arXiv 2405.04434, §3.1 and appendix): 60 layers, kv_lora_rank 512 + qk_rope_head_dim 64 = 576 cached
  elements per layer and token, deployed with the KV cache quantized to 6 bits per element on average;
- SnapKV (arXiv 2404.14469, §5.1): LWM-Text-Chat-1M (Llama-2-7B shape) on one A100-80GB up to 380K tokens, compressing
  each layer as its prompt is computed.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvbench import KvbenchError
from tests.plan.test_plan_layers import (
    GEMMA3_27B,  # (the fixtures folder)
    plan,
)

import transformers as _tf

# published configs as transformers >= 5.24 reads them (5.2, kvpress's venv, has no Gemma 4, caches DeepSeek-V2 per
# head and words its field errors otherwise): the figures below are for the main venv's transformers
pytestmark = pytest.mark.skipif(
    tuple(int(p) for p in _tf.__version__.split(".")[:2]) < (5, 24),
    reason=f"published-config planner figures need transformers >= 5.24 (this is {_tf.__version__})",
)

FIXTURES = GEMMA3_27B.parent


def test_gpt_oss_120b_in_mxfp4_fits_the_80_gb_gpu_its_card_names(tmp_path):
    rows = plan(tmp_path, str(FIXTURES / "gpt-oss-120b"), "hardware=h100-sxm", "dtype=bfloat16", "context=[4096]")
    point = rows.loc[(4096, 1)]
    assert point["weights_quant"] == "mxfp4"
    # before: 116.83 B params × 2 bytes = 233.7 GB, fits False, max_batch 0
    assert 60e9 < point["weights_bytes"] < 70e9 and bool(point["fits"]) and point["max_batch"] > 0


def test_deepseek_v2_with_a_6_bit_cache(tmp_path):
    rows = plan(
        tmp_path, str(FIXTURES / "deepseek-v2"), "hardware=h200", "dtype=bfloat16", "context=[131072]", "kv_dtype=6"
    )
    point = rows.loc[(131072, 1)]
    assert point["kv_bytes_full"] == 60 * 576 * 2 * 131072  # the bf16 cache: 69,120 B per token
    assert point["kv_bytes"] == 60 * 576 * 6 // 8 * 131072  # 25,920 B per token (before: not expressible)
    assert point["kv_ratio"] == pytest.approx(6 / 16)


@pytest.mark.parametrize(("kv_dtype", "ratio"), [("fp8", 0.5), ("int8", 0.5), ("int4", 0.25), (3, 3 / 16)])
def test_kv_dtypes_scale_the_cache(tmp_path, kv_dtype, ratio):
    rows = plan(
        tmp_path, str(FIXTURES / "lwm-text-chat-1m"), "dtype=bfloat16", "context=[8192]", f"kv_dtype={kv_dtype}"
    )
    assert rows.loc[(8192, 1), "kv_ratio"] == pytest.approx(ratio)


def test_snapkv_at_380k_on_an_a100_80gb_in_both_prefill_modes(tmp_path):
    common = ("hardware=a100-80gb", "dtype=bfloat16", "context=[380000]", "method=snapkv", "budget=1024")
    shared = plan(tmp_path / "s", str(FIXTURES / "lwm-text-chat-1m"), *common, "prefill=shared").loc[(380000, 1)]
    inline = plan(tmp_path / "i", str(FIXTURES / "lwm-text-chat-1m"), *common, "prefill=inline").loc[(380000, 1)]
    full = 32 * 2 * 32 * 128 * 2 * 380000  # every layer's K and V of the whole prompt, bf16: 199.2 GB
    snap_shared, snap_inline = (frame[frame["method"] == "snapkv"].iloc[0] for frame in (shared, inline))
    assert snap_shared["prefill_peak_bytes"] == full and not snap_shared["fits"]  # before: fits True
    assert snap_inline["prefill_peak_bytes"] == full // 32 and snap_inline["fits"]  # one layer at a time


def test_fits_agrees_with_max_batch(tmp_path):
    rows = plan(
        tmp_path,
        str(FIXTURES / "mistral-7b-v0.1"),
        "hardware=l40s",
        "dtype=bfloat16",
        "context=[1024,8192,32768]",
        "batch=[1,4,16,64]",
        "grid.method=[full,snapkv]",
        "grid.budget=[0.25]",
        "prefix=1024",
        "reuse=compress_once",
    ).reset_index()
    assert (rows["fits"] == (rows["batch"] <= rows["max_batch"])).all()
    assert not (rows["fits"] & (rows["max_batch"] == 0)).any()


def test_a_window_longer_than_the_context_is_compressed(tmp_path):
    # Mistral-7B-v0.1: sliding_window 4096 on every layer; below 4K tokens the window never fills
    rows = plan(tmp_path, str(FIXTURES / "mistral-7b-v0.1"), "context=[2048]", "method=snapkv", "budget=0.25")
    snap = rows.loc[(2048, 1)]
    snap = snap[snap["method"] == "snapkv"].iloc[0]
    assert snap["kv_ratio"] == pytest.approx(0.25, abs=0.02)  # before: 1.0 (every layer "sliding", never compressed)


def test_the_runs_refusals_hold_in_the_planner(tmp_path):
    for method in ("kivi", "hf-quant"):  # before: planned at kv_ratio 8x on the latent cache
        with pytest.raises(KvbenchError, match="latent attention \\(MLA\\)"):
            plan(tmp_path, str(FIXTURES / "deepseek-v2"), f"method={method}")
    with pytest.raises(KvbenchError, match="kv_dtype=fp8 with method kivi: the method sets the cache's precision"):
        plan(tmp_path, str(FIXTURES / "lwm-text-chat-1m"), "method=kivi", "kv_dtype=fp8")


BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"model_type": "mistral", "sliding_window": 1}, "sliding_window=1 for a sliding_attention layer"),
        ({"intermediate_size": 128.0}, "intermediate_size=128.0 is a float, not an integer"),
        ({"num_hidden_layers": 2**40}, "num_hidden_layers=1099511627776 is beyond 4096"),
        ({"quantization_config": {"quant_method": "exl9"}}, "quant_method=exl9 is not one the planner can count"),
    ],
    ids=["window-1", "float-field", "2^40-layers", "unknown-quant"],
)
def test_configs_it_cannot_plan_are_one_line(tmp_path, fields, line):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    with pytest.raises(KvbenchError, match=None) as refused:
        plan(tmp_path, str(tmp_path / "config.json"))
    assert line in str(refused.value) and "\n" not in str(refused.value)


def test_mixed_sliding_chunked_full_and_gemma_4_configs_plan(tmp_path):
    from transformers import AutoConfig

    mixed = {**BASE, "layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps({**mixed, "sliding_window": 16, "attention_chunk_size": 32}))
    rows = plan(tmp_path / "m", str(tmp_path / "config.json"), "context=[1024]", "dtype=float32")
    assert rows.loc[(1024, 1), "kv_bytes_full"] == 2 * 2 * 16 * 4 * (15 + 31 + 1024)
    AutoConfig.for_model("gemma4_text").save_pretrained(tmp_path / "gemma4")  # transformers' own Gemma 4 defaults
    rows = plan(tmp_path / "g", str(tmp_path / "gemma4"), "context=[4096]")  # before: a transformers traceback
    assert isinstance(rows, pd.DataFrame) and rows.loc[(4096, 1), "kv_bytes_full"] > 0
