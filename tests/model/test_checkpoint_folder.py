"""Local checkpoint folders that pass the config checks and then failed mid-load or ran a different model: each is
one line (exit 2) before any weight loads, in a run (`load_pretrained`) and in the planner."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.model import load
from tests.conftest import CONF_DIR
from tests.model.test_model_cache import edit_config, tiny_model


@pytest.fixture
def checkpoint(tmp_path):
    """A complete 2-layer Llama checkpoint with its tokenizer, saved the way transformers saves one."""
    tiny_model().save_pretrained(tmp_path / "ckpt")
    load.byte_tokenizer().save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def load_it(folder):
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / "hub.yaml"), {"name_or_path": str(folder)})
    return load.load_pretrained(cfg, torch.device("cpu"), torch.float32)


def test_a_complete_checkpoint_loads(checkpoint):
    assert load_it(checkpoint).n_layers == 2


def fewer_layers(folder):  # before: transformers ran the first layer and dropped the second, its notice silenced
    edit_config(folder, num_hidden_layers=1)


def wrong_shape(folder):  # before: a RuntimeError traceback from transformers' size-mismatch report
    edit_config(folder, intermediate_size=96)


def truncated(folder):  # before: a SafetensorError traceback ("incomplete metadata, file not fully covered")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def no_tokenizer(folder):  # before: a ValueError/OSError traceback from AutoTokenizer
    for name in load.TOKENIZER_FILES + ("tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)


def float_field(folder):  # before: transformers' StrictDataclassFieldValidationError traceback
    edit_config(folder, num_key_value_heads=2.0)


@pytest.mark.parametrize(
    ("damage", "line"),
    [
        (fewer_layers, "the weights hold 2 layers but config.json declares num_hidden_layers=1"),
        (wrong_shape, "has shape [128, 64] but config.json makes [96, 64]"),
        (truncated, "model.safetensors is truncated"),
        (no_tokenizer, "has no tokenizer files"),
        (float_field, "num_key_value_heads=2.0 is a float where the config needs an integer; write"),
    ],
    ids=["fewer-layers", "wrong-shape", "truncated", "no-tokenizer", "float-field"],
)
def test_a_broken_folder_is_one_line_before_any_weight_loads(checkpoint, damage, line):
    damage(checkpoint)
    with pytest.raises(KvbenchError, match=None) as refused:
        load_it(checkpoint)
    assert line in str(refused.value) and "\n" not in str(refused.value)
