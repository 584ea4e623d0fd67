"""The converted-model cache is verified before use, and no model runs with weights that did not load: a GGUF that
changed is converted again (one line), a damaged or mismatched folder is refused (one line: delete it, it is
converted again), a folder from before the completion marker is checked once and marked; a hub checkpoint lacking
weights of its config is refused unless model.allow_missing_weights=true. The GGUF reader is replaced by a tiny
random Llama (a real GGUF conversion takes 20 s to a minute); everything after it is the real code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, LlamaConfig

from kvbench import KvbenchError
from kvbench.model import conversion, gguf_models, load
from tests.conftest import CONF_DIR

ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(**ARCH, vocab_size=300, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.fixture
def bundled(tmp_path, monkeypatch):
    """The bundled model's loader on a fake GGUF in tmp_path, its cache in tmp_path/cache; returns a loader that
    gives (LoadedModel, stdout) and counts the conversions."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF version 1")
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_models, "bundled_gguf_path", lambda package, filename: gguf)
    conversions = []

    def read_gguf(path):
        conversions.append(path.read_bytes())
        return tiny_model(), load.byte_tokenizer()

    monkeypatch.setattr(conversion, "read_gguf", read_gguf)
    cfg = OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml")

    def run(capsys):
        lm = load.load_bundled_gguf(cfg, torch.device("cpu"), torch.float32)
        return lm, capsys.readouterr().out

    run.gguf, run.target, run.conversions = gguf, load.converted_dir(cfg.name), conversions
    return run


def test_a_conversion_is_marked_complete_and_loads_without_converting_again(bundled, capsys):
    lm, out = bundled(capsys)
    assert "converting model.gguf once" in out and len(bundled.conversions) == 1
    marker = json.loads((bundled.target / load.MARKER).read_text())
    assert marker["source"]["sha256"] == load.file_digest(bundled.gguf)
    assert marker["files"]["model.safetensors"] == (bundled.target / "model.safetensors").stat().st_size
    assert not list(bundled.target.parent.glob("*.tmp*")) and not list(bundled.target.parent.glob("*.old-*"))
    again, out = bundled(capsys)
    assert out == "" and len(bundled.conversions) == 1
    assert torch.equal(again.model.lm_head.weight, lm.model.lm_head.weight)


def test_a_changed_gguf_is_converted_again_saying_so(bundled, capsys):
    bundled(capsys)
    bundled.gguf.write_bytes(b"GGUF version 2")  # a reinstalled package with another model file
    _, out = bundled(capsys)
    assert "was converted from another model.gguf" in out and "converting it again" in out
    assert len(bundled.conversions) == 2 and bundled.conversions[-1] == b"GGUF version 2"
    assert json.loads((bundled.target / load.MARKER).read_text())["source"]["sha256"] == load.file_digest(bundled.gguf)


def test_a_touched_gguf_with_the_same_content_is_not_converted_again(bundled, capsys):
    import os

    bundled(capsys)
    os.utime(bundled.gguf, ns=(1, 1))
    _, out = bundled(capsys)
    assert len(bundled.conversions) == 1 and out == ""
    assert json.loads((bundled.target / load.MARKER).read_text())["source"]["mtime_ns"] == 1  # re-marked: not rehashed


def edit_config(target: Path, **changes) -> None:
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda t: (t / "model.safetensors").unlink(), "has model.safetensors missing"),
        (lambda t: (t / "model.safetensors").write_bytes(b"\0" * 64), "has model.safetensors of 64 bytes"),
        (lambda t: edit_config(t, num_hidden_layers=3), "has config.json of"),  # edited after the conversion
    ],
    ids=["weights-missing", "weights-truncated", "config-edited"],
)
def test_a_damaged_or_mismatched_conversion_is_refused_not_run_partly_random(bundled, capsys, damage, why):
    bundled(capsys)
    damage(bundled.target)
    with pytest.raises(KvbenchError) as refused:
        bundled(capsys)
    line = str(refused.value)
    assert why in line and f"delete it (rm -r {bundled.target}) and rerun: it is converted again" in line, line
    assert "\n" not in line and len(bundled.conversions) == 1


def test_a_conversion_from_before_the_marker_is_checked_once_and_marked(bundled, capsys):
    bundled(capsys)
    (bundled.target / load.MARKER).unlink()  # as every cache converted by an earlier kvbench
    _, out = bundled(capsys)
    assert "checked the converted model" in out and "once (every weight loads) and marked it" in out
    assert (bundled.target / load.MARKER).exists() and len(bundled.conversions) == 1  # not converted again
    assert bundled(capsys)[1] == ""


@pytest.mark.parametrize(
    "layers, why", [(3, "9 weights missing (would be random)"), (1, "9 weights unexpected (unused by its config)")]
)
def test_an_unmarked_conversion_whose_weights_do_not_all_load_is_refused(bundled, capsys, layers, why):
    bundled(capsys)
    (bundled.target / load.MARKER).unlink()
    edit_config(bundled.target, num_hidden_layers=layers)  # unmarked: only loading it tells
    with pytest.raises(KvbenchError) as refused:
        bundled(capsys)
    assert f"does not match its config: {why}" in str(refused.value) and "delete it (rm -r" in str(refused.value)
    assert not (bundled.target / load.MARKER).exists()


def test_an_unmarked_conversion_cut_short_is_refused(bundled, capsys):
    bundled(capsys)
    for name in (load.MARKER, "model.safetensors"):  # what an interrupted copy or an old, non-atomic one leaves
        (bundled.target / name).unlink()
    with pytest.raises(KvbenchError, match=r"is unreadable \(.*delete it \(rm -r"):
        bundled(capsys)


@pytest.fixture
def partial_checkpoint(tmp_path):
    """A local hub-style checkpoint whose config has one layer more than its weights."""
    tiny_model().save_pretrained(tmp_path / "ckpt")
    load.byte_tokenizer().save_pretrained(tmp_path / "ckpt")
    edit_config(tmp_path / "ckpt", num_hidden_layers=3)
    return tmp_path / "ckpt"


def test_a_hub_checkpoint_missing_weights_is_refused_unless_allowed(partial_checkpoint, capsys):
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "model" / "hub.yaml"), {"name_or_path": str(partial_checkpoint)})
    with pytest.raises(KvbenchError) as refused:
        load.load_pretrained(cfg, torch.device("cpu"), torch.float32)
    line = str(refused.value)
    assert "does not hold every weight of its config: 9 weights missing (would be random)" in line
    assert line.endswith("model.allow_missing_weights=true to run it with those weights random")
    cfg.allow_missing_weights = True
    lm = load.load_pretrained(cfg, torch.device("cpu"), torch.float32)
    assert lm.n_layers == 3 and "9 weights missing" in capsys.readouterr().err


def test_random_architecture_models_still_build_their_random_weights(tiny):
    assert tiny.n_layers == OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml").architecture.num_hidden_layers


def test_a_conversion_from_before_versioned_folders_is_removed(tmp_path, monkeypatch):
    """One folder per transformers version: the files an older kvbench converted straight into the model's folder
    (its marker lists them) go when the versioned folder is made; anything else there stays."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    folder = load.converted_dir("smollm2-135m").parent
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    conversion.write_marker(folder, {"file": "x.gguf", "sha256": "0"})  # lists model.safetensors
    (folder / "notes.txt").write_text("mine")
    load._make_cache_dir(load.converted_dir("smollm2-135m"))
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
