"""Settings that would run and store rows under a method's name while the method does nothing, or a model section
whose typo the model would ignore: each is refused before the model loads in one line, or said plainly."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench import KvbenchError
from kvbench.methods import build_method
from kvbench.model.load import model_config
from kvbench.preflight.support import refusal
from kvbench.run.runner import compressed_nothing
from tests.model.families import FAMILIES


def test_turboquant_whose_boundary_layers_cover_the_model_is_refused():
    config = FAMILIES["llama-gqa"]()  # 4 layers: boundary 2 keeps the first 2 and the last 2, i.e. all
    reason = refusal(build_method("turboquant", {"boundary_layers": 2}), config)
    assert reason is not None and "\n" not in reason and "compress nothing" in reason and "< 2" in reason
    assert refusal(build_method("turboquant", {"boundary_layers": 1}), config) is None


def test_a_typo_in_the_architecture_section_is_one_line():
    arch = {"num_hiden_layers": 3, "hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(KvbenchError, match="num_hiden_layers is not a LlamaConfig field; did you mean num_hidden_"):
        model_config({"name": "t", "loader": "tiny_random", "architecture": arch})
    legacy = {"rope_theta": 5.0, "hidden_size": 64, "num_attention_heads": 4}  # folded into rope_parameters: fine
    assert (
        model_config({"name": "t", "loader": "tiny_random", "architecture": legacy}).rope_parameters["rope_theta"] == 5
    )


def test_a_budget_that_kept_everything_is_said_plainly():
    rows = pd.DataFrame(
        {
            "task": ["niah"] * 4,
            "method": ["full", "full", "snapkv", "snapkv"],
            "budget": [1.0, 1.0, 0.25, 0.25],
            "kv_ratio": [1.0, 1.0, 1.0, 1.0],  # every layer slides within a window the budget covers
        }
    )
    (line,) = compressed_nothing(rows)
    assert "snapkv at budget 0.25 on niah compressed nothing" in line
    assert compressed_nothing(rows.assign(kv_ratio=[1.0, 1.0, 0.5, 1.0])) == []  # one row compressed: no claim


def test_the_run_says_so_on_a_model_whose_every_layer_slides(tmp_path, capsys):
    from kvbench.run.runner import run
    from tests.conftest import compose_config, tiny_overrides

    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith("model=")]
    cfg = compose_config(
        *overrides,
        "model=tiny-random",
        "model.loader=random_init",
        "+model.architecture.model_type=mistral",
        "+model.architecture.sliding_window=512",
        "grid.method=[snapkv]",
        "grid.budget=[0.75]",
        "task.context_lengths=[700]",
        "task.depths=[0.5]",
    )
    run(cfg, tmp_path / "run")
    assert "snapkv at budget 0.75 on niah compressed nothing" in capsys.readouterr().out


def test_an_engine_option_cannot_be_renamed_by_its_knobs():
    from kvbench.engines.vllm import VllmEngine
    from kvbench.preflight.entrance import renamed_option

    options = VllmEngine.options
    reason = renamed_option("vllm", options, "fp8", {"name": "fp8", "kv_cache_dtype": "int8_per_token_head"})
    assert reason is not None and "\n" not in reason and "use method=int8_per_token_head" in reason
    second_full = renamed_option("vllm", options, "full", {"name": "full", "kv_cache_dtype": "fp8_e5m2"})
    assert second_full is not None and "use method=fp8_e5m2" in second_full  # not a second, different baseline
    assert renamed_option("vllm", options, "fp8", {"name": "fp8", "kv_cache_dtype": "fp8"}) is None
    assert renamed_option("vllm", options, "fp8", {"name": "fp8", "enable_prefix_caching": True}) is None


def test_ids_outside_the_vocabulary_make_an_engine_row_invalid():
    from types import SimpleNamespace

    import transformers as tf

    from kvbench.rows.build import out_of_vocabulary

    lm = SimpleNamespace(config=tf.LlamaConfig(vocab_size=320))
    assert out_of_vocabulary([5, 319], lm) == ""
    reason = out_of_vocabulary([5, 320, 70000], lm)
    assert "2 ids outside the model's vocabulary of 320 (e.g. 320)" in reason


def test_an_engine_option_given_as_method_names_the_grid_form():
    from kvbench.__main__ import engine_option_as_method

    line = engine_option_as_method(["engine=llamacpp", "method=q8_0"])
    assert line == "method=q8_0 is engine=llamacpp's option, not a kvbench method: give it as 'grid.method=[q8_0]'"
    assert engine_option_as_method(["engine=llamacpp", "method=snapkv"]) is None  # a kvbench method (llama.cpp applies)
    assert engine_option_as_method(["method=q8_0"]) is None  # no engine: Hydra's own list of methods
