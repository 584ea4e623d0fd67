"""The planner on published hybrid models (configs in tests/fixtures, copied from each model's config.json on the hub):
attention K/V per token × context plus a constant state per request, and what a KV method can touch.

Published figures each test checks against:
- Jamba (arXiv 2403.19887, Table 1): at 256K tokens in 16 bits the KV cache is 4GB for Jamba against 32GB for Mixtral
  (GiB: 4 of Jamba's 32 layers are attention, every one of Mixtral's);
- Nemotron-H-8B (nvidia/Nemotron-H-8B-Base-8K config.json): 4 attention layers of 52 (24 Mamba-2, 24 MLP);
- Qwen3-Next-80B-A3B and Qwen3.5-9B (their config.json): a full-attention layer every 4, Gated DeltaNet elsewhere;
  Qwen3-Next holds 79,674,391,296 parameters (its checkpoint's total);
- Granite-4.0-H-Small (ibm-granite/granite-4.0-h-small config.json: 36 Mamba-2 and 4 attention layers of 40, 32B
  parameters): its Mamba heads' split (128 × 64 = mamba_expand × hidden, which fixes the recurrent state whatever the
  split) and one group (transformers' default) are filled in, as are the attention layers' places (bytes do not
  depend on them).
"""

from __future__ import annotations

import pytest
import transformers as _tf

from tests.plan.test_plan_layers import GEMMA3_27B, plan

pytestmark = pytest.mark.skipif(  # 5.2 (kvpress's venv) reads these configs otherwise; the planner follows 5.24+
    tuple(int(p) for p in _tf.__version__.split(".")[:2]) < (5, 24),
    reason=f"published hybrid configs are planned as transformers >= 5.24 reads them (this is {_tf.__version__})",
)
FIXTURES = GEMMA3_27B.parent
GIB = 2**30


def test_jamba_holds_an_eighth_of_mixtrals_kv_cache_at_256k(tmp_path):
    common = ("hardware=h200", "dtype=bfloat16", "context=[262144]", "extrapolate=true")
    jamba = plan(tmp_path / "jamba", str(FIXTURES / "jamba-v0.1"), *common).loc[(262144, 1)]
    mixtral = plan(tmp_path / "mixtral", str(FIXTURES / "mixtral-8x7b"), *common).loc[(262144, 1)]
    assert mixtral["kv_bytes_full"] == 32 * GIB  # 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 B × 256K
    state = 28 * (8192 * 4 * 2 + 8192 * 16 * 4)  # 28 Mamba layers: conv (bf16) + recurrent state (fp32)
    assert jamba["kv_bytes_full"] == 4 * GIB + state
    assert jamba["compressible_share"] == pytest.approx(4 * GIB / (4 * GIB + state))


@pytest.mark.parametrize(
    ("model", "attention_per_token", "state", "params"),
    [
        # 4 attention layers × 8 KV heads × 128 × 2 × 2 B; 24 Mamba-2 layers: (8192 + 2·8·128) × 4 conv + 128·64·128
        ("nemotron-h-8b", 4 * 4096, 24 * ((8192 + 2 * 8 * 128) * 4 * 2 + 128 * 64 * 128 * 4), 8.1e9),
        # 12 attention layers × 2 KV heads × 256 × 2 × 2 B; 36 GDN layers: (2·16·128 + 32·128) × 4 conv + 32·128·128
        ("qwen3-next-80b-a3b", 12 * 2048, 36 * ((2 * 2048 + 4096) * 4 * 2 + 32 * 128 * 128 * 4), 79_674_391_296),
        ("qwen3.5-9b", 8 * 4096, 24 * ((2 * 2048 + 4096) * 4 * 2 + 32 * 128 * 128 * 4), 8.95e9),
        # 4 attention layers × 8 KV heads × 128; 36 Mamba-2 layers: (128·64 + 2·128) × 4 conv + 128·64·128 (32 B total)
        ("granite-4.0-h-small", 4 * 4096, 36 * ((8192 + 256) * 4 * 2 + 128 * 64 * 128 * 4), 32.2e9),
    ],
)
def test_hybrids_plan_kv_per_token_plus_a_constant_state(tmp_path, model, attention_per_token, state, params):
    rows = plan(
        tmp_path,
        str(FIXTURES / model),
        "hardware=h200",
        "dtype=bfloat16",
        "context=[32768,131072]",
        "extrapolate=true",
        "method=snapkv",
        "budget=0.25",
    )
    full = rows[rows["variant"] == "full"]
    snapkv = rows[rows["variant"] == "snapkv"]
    for context in (32768, 131072):
        point = full.loc[(context, 1)]
        assert point["kv_bytes_full"] == attention_per_token * context + state
        assert point["compressible_share"] == pytest.approx(attention_per_token * context / point["kv_bytes_full"])
        # SnapKV at 0.25 keeps a quarter of the attention K/V and the whole state
        assert snapkv.loc[(context, 1), "kv_bytes"] == attention_per_token * context // 4 + state
    assert full.iloc[0]["weights_bytes"] == pytest.approx(2 * params, rel=0.01)
