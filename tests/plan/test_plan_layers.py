"""The planner by layer type: sliding layers at their window, latent layers at their latent width, Falcon's cached
heads, and the largest context bounded by the model's own position limit."""

from __future__ import annotations

import json
from types import SimpleNamespace
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from kvbench.plan.planner import run_plan
from kvbench.model.layout import caches_latent
from tests.conftest import CONF_DIR

GEMMA3_27B = Path(__file__).resolve().parents[1] / "fixtures" / "gemma-3-27b"  # its published text configuration


def plan(tmp_path, model: str, *overrides) -> pd.DataFrame:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("plan", overrides=["plot=false", "model=hub", f"model.name_or_path={model}", *overrides])
    run_plan(cfg, tmp_path)
    return pd.read_csv(tmp_path / "plan.csv").set_index(["context", "batch"])


def test_gemma_3_27b_holds_its_window_on_52_of_62_layers(tmp_path, capsys):
    rows = plan(tmp_path, str(GEMMA3_27B), "hardware=h200", "dtype=bfloat16", "context=[32768,131072]", "batch=[1]")
    per_layer_token = 2 * 16 * 128 * 2  # K + V, 16 KV heads × 128, bf16
    for context in (32768, 131072):
        full = per_layer_token * (10 * context + 52 * 1023)  # 10 global layers; 52 sliding ones keep 1,023 tokens
        assert rows.loc[(context, 1), "kv_bytes_full"] == full
        assert rows.loc[(context, 1), "kv_bytes_full_dense"] == per_layer_token * 62 * context
    assert rows.loc[(32768, 1), "kv_bytes_full"] == 3_120_136_192  # 5.3x below the every-layer formula
    assert rows.loc[(131072, 1), "compressible_share"] == pytest.approx(10 * 131072 / (10 * 131072 + 52 * 1023))
    assert rows.loc[(131072, 1), "max_context"] <= 131072  # the model's max_position_embeddings, not the search cap
    out = capsys.readouterr().out
    assert "52 sliding layers × 4096 (K+V) × 2 B = 425,984 B for the last 1023 tokens" in out
    assert "10 global layers × 4096 (K+V) × 2 B = 81,920 B" in out


@pytest.mark.parametrize(
    ("config", "per_token"),
    [
        # Falcon-7B-style multi_query: one cached KV head although num_kv_heads defaults to the query heads
        (
            {
                "model_type": "falcon",
                "hidden_size": 4544,
                "num_hidden_layers": 32,
                "num_attention_heads": 71,
                "multi_query": True,
                "new_decoder_architecture": False,
                "vocab_size": 65024,
                "alibi": False,
            },
            32 * 2 * 1 * 64 * 2,
        ),
        # DeepSeek-V3-style latent attention: kv_lora_rank 512 + qk_rope_head_dim 64 per layer and token
        (
            {
                "model_type": "deepseek_v3",
                "hidden_size": 1024,
                "num_hidden_layers": 4,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "kv_lora_rank": 512,
                "q_lora_rank": 256,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128,
                "v_head_dim": 128,
                "intermediate_size": 2048,
                "moe_intermediate_size": 256,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                "vocab_size": 1000,
                "max_position_embeddings": 8192,
            },
            4 * (512 + 64) * 2,
        ),
    ],
    ids=["falcon-mqa", "mla"],
)
def test_bytes_per_token_follow_what_the_cache_holds(tmp_path, config, per_token):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    # extrapolate: Falcon-7B's config writes no position limit, so transformers' default (2048) applies
    rows = plan(
        tmp_path, str(path), "hardware=h200", "dtype=bfloat16", "context=[4096]", "batch=[1]", "extrapolate=true"
    )
    if "kv_lora_rank" in config and not caches_latent(SimpleNamespace(model_type=config["model_type"])):
        per_token = 4 * 16 * (128 + 64 + 128) * 2  # transformers 5.2 (kvpress's pin) caches every head's K and V
    assert rows.loc[(4096, 1), "kv_bytes_full"] == per_token * 4096
