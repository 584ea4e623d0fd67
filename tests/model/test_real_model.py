"""A few checks on the bundled SmolLM2-135M (real weights, CPU, dtype=auto: bf16 with AVX512-BF16/AMX, else fp32;
CI runs them both ways with KVBENCH_NO_BF16=1)."""

import pytest
from omegaconf import OmegaConf

from kvbench.methods import Budget, build_method
from kvbench.model.load import load_model
from kvbench.native.engine import Engine
from kvbench.tasks import build_task
from tests.conftest import CONF_DIR

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smol():
    lm = load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"), "cpu", "auto")
    return lm, Engine(lm)


def _examples(lm, lengths, depths):
    cfg = OmegaConf.load(CONF_DIR / "task" / "niah.yaml")
    cfg.update({"context_lengths": lengths, "depths": depths})
    task = build_task(cfg, lm.tokenizer, 0)
    return task, task.examples()


def test_bundled_model_shape(smol):
    lm, _ = smol
    assert (lm.n_layers, lm.n_q_heads, lm.n_kv_heads, lm.head_dim, lm.max_context) == (30, 9, 3, 64, 8192)


def test_full_cache_finds_the_needle_at_1k(smol):
    lm, engine = smol
    task, examples = _examples(lm, [1024], [0.1, 0.5, 0.9])
    # K and V of every layer in the dtype auto chose: 23,040 bytes a token in bf16, 46,080 in fp32
    token_bytes = 2 * lm.n_layers * lm.n_kv_heads * lm.head_dim * lm.dtype.itemsize
    assert token_bytes == {"torch.bfloat16": 23_040, "torch.float32": 46_080}[str(lm.dtype)]
    for ex in examples:
        gen = engine.run(build_method("full"), None, *ex.split(True), max_new_tokens=ex.max_new_tokens)
        assert task.score(gen.text, ex)["score"] == 1.0, (ex.example_id, gen.text)
        assert gen.kv_bytes == token_bytes * (ex.n_tokens + gen.decode_steps)


def test_streamingllm_loses_a_needle_it_evicted(smol):
    lm, engine = smol
    task, (ex,) = _examples(lm, [1024], [0.1])
    gen = engine.run(build_method("streamingllm"), Budget.parse(0.3), *ex.split(True), max_new_tokens=ex.max_new_tokens)
    assert task.score(gen.text, ex)["score"] == 0.0  # the needle at 10 % depth is outside sinks + recent 30 %
    assert 0.28 < gen.kv_ratio < 0.32


def test_shared_prefill_grid_equals_one_by_one_on_the_real_model(smol, tmp_path):
    from kvbench.run.runner import run
    from tests.conftest import compose_config

    base = ["device=cpu", "report=false", "task.context_lengths=[1024]", "task.depths=[0.1]", "task.max_new_tokens=12"]
    grid = run(
        compose_config(
            *base,
            f"results_dir={tmp_path / 'g'}",
            "grid.method=[snapkv,h2o,streamingllm,pyramidkv]",
            "grid.budget=[0.25]",
        ),
        output_dir=tmp_path / "go",
    )
    for name in ("snapkv", "h2o", "streamingllm", "pyramidkv"):
        single = run(
            compose_config(*base, f"results_dir={tmp_path / name}", f"method={name}", "budget=0.25"),
            output_dir=tmp_path / f"{name}o",
        )
        a = grid[grid.method == name].iloc[0]
        b = single[single.method == name].iloc[0]
        assert (a.prediction, a.kv_bytes, a.score) == (b.prediction, b.kv_bytes, b.score)
