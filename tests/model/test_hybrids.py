"""Hybrid models (kvbench.model.states): linear-attention, Mamba and convolution layers beside attention layers.

Per family (tests/model/families.py HYBRIDS): the layout's bytes are what transformers' own cache holds after the same
tokens (fp32 and bf16: the recurrent state stays fp32), the full cache decodes as transformers' `generate`, a budget of
1.0 is exact, SnapKV and StreamingLLM at 0.25 hold less than the full cache but never less than the states, and a
prefill shared by several configurations gives each the rows it gives alone (each decodes from its own copy of the
states). The families the architecture matrix runs every method on are these too (test_architectures.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
import transformers.cache_utils as cache_utils

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.model.cache import cache_nbytes
from kvbench.model.layout import cache_layout
from kvbench.model.load import byte_tokenizer, finish
from kvbench.native.engine import Engine
from kvbench.preflight.support import refusal
from tests.model.families import FAMILIES, HYBRIDS, build

PROMPT, NEW = 150, 5
# transformers 5.2 (kvpress's venv) keeps no hybrid's state in DynamicCache (its LinearAttentionLayer came later)
pytestmark = pytest.mark.skipif(
    not hasattr(cache_utils, "LinearAttentionLayer"), reason=f"transformers {tf.__version__} has no hybrid cache"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", HYBRIDS)
def test_layout_bytes_are_transformers_own_cache(name, dtype):
    model = build(name, dtype=dtype)
    own = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + PROMPT)[None], cache=own, use_cache=True)
    layout = cache_layout(model.config, dtype)
    assert layout.is_hybrid and layout.state_bytes() > 0
    assert layout.full_bytes(PROMPT) == cache_nbytes(own)
    assert layout.full_bytes(PROMPT) - layout.attention_bytes(PROMPT) == layout.state_bytes()
    assert layout.full_bytes(2 * PROMPT) - layout.full_bytes(PROMPT) == layout.attention_bytes(PROMPT)  # K/V grow


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    lm = finish(build(request.param), byte_tokenizer(), request.param, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, 300, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = Engine(lm)
    full = build_method("full")
    gen = engine.generate(engine.prefill(ids, full.stats_request()), full, None, [], NEW, keep_logits=True)
    return lm, engine, ids, gen


def test_full_cache_is_transformers_generate_and_counts_the_states(hybrid):
    lm, _, ids, full = hybrid
    hf = lm.model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, PROMPT:]
    assert full.token_ids == hf.tolist()
    tokens = PROMPT + full.decode_steps
    assert full.kv_bytes == full.kv_bytes_full == lm.layout.full_bytes(tokens)
    assert full.kv_bytes_full > lm.layout.attention_bytes(tokens)  # the states are counted


@pytest.mark.parametrize("method_name", ["snapkv", "streamingllm", "h2o", "pyramidkv", "knorm"])
def test_budget_one_is_exact_and_a_quarter_holds_less(hybrid, method_name):
    lm, engine, ids, full = hybrid
    method = build_method(method_name, method_defaults(method_name))
    reason = refusal(method, lm.config)
    if reason is not None:  # latent attention (Kimi Linear), a shared attention block (Zamba2): one line, tested below
        pytest.skip(reason)
    same = engine.generate(
        engine.prefill(ids, method.stats_request()), method, Budget.parse(1.0), [], NEW, keep_logits=True
    )
    assert same.token_ids == full.token_ids
    assert all(torch.equal(a, b) for a, b in zip(same.logits, full.logits))
    small = engine.generate(engine.prefill(ids, method.stats_request()), method, Budget.parse(0.25), [], NEW)
    states = lm.layout.state_bytes()
    assert states < small.kv_bytes < full.kv_bytes
    attention = lm.layout.attention_bytes(PROMPT + small.decode_steps)
    assert small.kv_bytes - states < 0.5 * attention  # the attention layers are what shrank


def test_one_prefill_serves_every_configuration(hybrid):
    """Decoding moves each configuration's states forward in place: the prefill's own must stay as the prompt left
    them, so the second configuration of a shared prefill decodes as it does after a prefill of its own."""
    _, engine, ids, _ = hybrid
    scorer, streaming = build_method("random"), build_method("streamingllm")  # both run on every hybrid
    shared = engine.prefill(ids, scorer.stats_request() | streaming.stats_request())
    first = engine.generate(shared, scorer, Budget.parse(0.25), [], NEW, keep_logits=True)
    second = engine.generate(shared, streaming, Budget.parse(0.25), [], NEW, keep_logits=True)
    alone = engine.generate(
        engine.prefill(ids, streaming.stats_request()), streaming, Budget.parse(0.25), [], NEW, keep_logits=True
    )
    again = engine.generate(shared, scorer, Budget.parse(0.25), [], NEW, keep_logits=True)
    assert second.token_ids == alone.token_ids and all(torch.equal(a, b) for a, b in zip(second.logits, alone.logits))
    assert again.token_ids == first.token_ids and all(torch.equal(a, b) for a, b in zip(again.logits, first.logits))


def test_methods_that_need_every_layer_attention_are_refused_in_one_line():
    config = FAMILIES["lfm2"]()  # full RoPE, separate q/k/v projections: refused for being a hybrid alone
    for name in ("headmerge", "kvzip", "hf-quant"):
        reason = refusal(build_method(name, method_defaults(name)), config)
        assert reason is not None and "\n" not in reason and "linear-attention or state-space layers" in reason
    assert refusal(build_method("snapkv"), config) is None


def test_what_cannot_run_on_a_hybrid_is_one_line():
    zamba2, kimi, falcon = (FAMILIES[name]() for name in ("zamba2", "kimi_linear", "falcon_h1"))
    reasons = {
        "attention block shared": refusal(build_method("snapkv"), zamba2),  # one block serves every hybrid layer
        "latent attention": refusal(build_method("snapkv"), kimi),
        "cache layers of its own": refusal(build_method("kivi", {"group_size": 16}), falcon),  # K/V + state, one layer
    }
    for words, reason in reasons.items():
        assert reason is not None and "\n" not in reason and words in reason
    minimax = tf.MiniMaxConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    assert "cache of its own" in refusal(build_method("full"), minimax)


def test_a_model_without_attention_layers_is_one_line():
    config = tf.Qwen3_5TextConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        layer_types=["linear_attention"] * 2,
    )
    with pytest.raises(KvbenchError, match="no attention layer"):
        cache_layout(config, torch.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each hybrid family saved as transformers saves a checkpoint, with a tokenizer: what `model=hub` loads."""
    root = tmp_path_factory.mktemp("hybrids")
    for name in HYBRIDS:
        build(name).save_pretrained(root / name)
        byte_tokenizer().save_pretrained(root / name)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_checkpoint_runs_through_model_hub(checkpoints, tmp_path, name):
    """The issue's bar: full, SnapKV (or, where statistics cannot be read, Knorm) and StreamingLLM at 0.25 through
    `model=hub` on a saved checkpoint; the full row holds more than its attention K/V (the states are counted), the
    compressed rows hold less than the full one, never less than the states."""
    from kvbench.run.runner import run
    from tests.conftest import compose_config, tiny_overrides

    config = FAMILIES[name]()
    scorer = next(m for m in ("snapkv", "knorm", "random") if refusal(build_method(m), config) is None)
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith("model=")]
    cfg = compose_config(
        *overrides,
        "model=hub",
        f"model.name_or_path={checkpoints / name}",
        f"grid.method=[{scorer},streamingllm]",
        "grid.budget=[0.25]",
        "task.context_lengths=[700]",
        "task.depths=[0.5]",
    )
    rows = run(cfg, tmp_path / "run")
    layout = cache_layout(config, torch.float32)
    full = rows[rows["method"] == "full"].iloc[0]
    assert full["state_bytes"] == layout.state_bytes() > 0
    assert full["kv_bytes"] == full["kv_bytes_full"] > layout.attention_bytes(int(full["context_tokens"]))
    for method in (scorer, "streamingllm"):
        row = rows[rows["method"] == method].iloc[0]
        assert row["state_bytes"] < row["kv_bytes"] < full["kv_bytes"]


def test_serving_and_lm_eval_refuse_a_hybrid_in_one_line(checkpoints):
    from kvbench.integrations.lm_eval_model import from_model_args
    from kvbench.model.kv_bytes import KVShape
    from kvbench.serving.inputs import check_fit

    with pytest.raises(KvbenchError, match="lm-eval on a hybrid model"):
        from_model_args({"pretrained": str(checkpoints / "qwen3_5")})
    shape = KVShape(4, 2, 16, torch.float32, cache_layout(FAMILIES["qwen3_5"](), torch.float32))
    with pytest.raises(KvbenchError, match="serving a hybrid model"):
        check_fit(shape, 2048, [], [10**9], 100, 10, "a request")


def test_a_hybrid_config_transformers_cannot_build_is_one_line(tmp_path):
    """A checkpoint folder whose config transformers refuses (a str where it needs an int): the run's line names the
    folder and transformers' reason, as the planner's does (before: a traceback from its strict fields)."""
    import json

    from kvbench.model.load import model_config

    bad = FAMILIES["qwen3_5"]().to_dict() | {"linear_num_key_heads": "x"}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(KvbenchError, match="not one transformers can build .*linear_num_key_heads"):
        model_config({"name": "hub", "loader": "pretrained", "name_or_path": str(tmp_path)})
