"""Large and odd task inputs, by class: haystack / perplexity files that are binary or too large are refused before
the model loads, lengths no model can take are refused before any prompt is built, and a long haystack costs only
the sentences a prompt takes."""

from __future__ import annotations

import os
import re

import pytest

from kvbench import KvbenchError
from kvbench.preflight.entrance import check_config
from kvbench.tasks import build_task
from tests.conftest import compose_config


def _haystack(task: str, path) -> list[str]:
    key = "text" if task == "ppl" else "haystack"
    return [f"task={task}", f"task.{key}=file", f"task.{key}_files=[{path}]"]


@pytest.mark.parametrize("task", ["niah", "ppl", "shared_doc", "shared_doc_qa"])
@pytest.mark.parametrize(
    "content, fix",
    [
        (os.urandom(4096), "is not UTF-8 text"),  # random bytes
        (b"The grass is green.\x00" * 100, "is not UTF-8 text"),  # NULs: a binary format
        ("Caf\xe9 au lait. ".encode("latin-1") * 50, "iconv -t utf-8"),  # a legacy encoding
    ],
    ids=["random bytes", "nul bytes", "latin-1"],
)
def test_binary_text_files_are_refused_before_the_model_loads(tmp_path, task, content, fix):
    (tmp_path / "h.txt").write_bytes(content)
    with pytest.raises(KvbenchError, match=fix) as error:
        check_config(compose_config(*_haystack(task, tmp_path / "h.txt")))
    assert "\n" not in str(error.value) and str(tmp_path / "h.txt") in str(error.value)


@pytest.mark.parametrize("task", ["niah", "ppl", "shared_doc"])
def test_text_files_above_the_bound_are_refused(tmp_path, monkeypatch, task):
    monkeypatch.setattr("kvbench.tasks.haystack.MAX_TEXT_BYTES", 1000)
    (tmp_path / "h.txt").write_text("The sky is blue. " * 100)  # 1,700 bytes
    with pytest.raises(KvbenchError, match=r"above the 0 MiB kvbench reads.*head -c"):
        check_config(compose_config(*_haystack(task, tmp_path / "h.txt")))


@pytest.mark.parametrize(
    "overrides, fix",
    [
        (["task.context_lengths=[20000]"], "task.context_lengths: 20,000 prompt + 24 new tokens is more than"),
        (["task=ruler_synthetic", "task.context_lengths=[20000]"], "task.context_lengths: 20,000 prompt + 0 new"),
        (["task=ruler", "task.context_lengths=[20000]"], "task.context_lengths: 20,000 prompt + 0 new"),
        (["task=shared_doc", "task.context_length=16380"], "task.context_length: 16,380 prompt + 24 new"),
        (["task=multiturn", "task.context_length=99999"], "use lengths ≤ 16,360"),
    ],
)
def test_lengths_above_the_model_are_refused_before_any_prompt(overrides, fix, monkeypatch):
    cfg = compose_config(*overrides)
    built = []
    monkeypatch.setattr("kvbench.tasks.niah.NeedleInAHaystack.examples", lambda self: built.append(1))
    with pytest.raises(KvbenchError, match=re.escape(fix)):
        build_task(cfg.task, tokenizer=None, seed=0, max_context=16384)  # the tiny model's window
    assert not built
    build_task(cfg.task, tokenizer=None, seed=0, max_context=None)  # a window not known: examples say later


@pytest.mark.parametrize(
    "overrides", [["task.context_lengths=[1000000000]"], ["task=ppl", "task.length=100000000", "task.chunk=256"]]
)
def test_absurd_lengths_are_refused_before_the_model_loads(overrides):
    with pytest.raises(KvbenchError, match="above the 16,777,216 kvbench builds a prompt of"):
        check_config(compose_config(*overrides))


def test_a_long_haystack_tokenizes_only_what_the_prompt_takes(tmp_path, tiny, monkeypatch):
    """200 K sentences in the file; a 1K-token prompt encodes a few hundred of them."""
    from kvbench.tasks.niah import NeedleInAHaystack

    (tmp_path / "h.txt").write_text(" ".join(f"Sentence number {i} is here." for i in range(200_000)))
    overrides = ["task.haystack=file", f"task.haystack_files=[{tmp_path / 'h.txt'}]", "task.context_lengths=[1024]"]
    cfg = compose_config(*overrides, "task.depths=[0.5]")
    calls = []
    encode = NeedleInAHaystack._encode
    monkeypatch.setattr(NeedleInAHaystack, "_encode", lambda self, text: calls.append(1) or encode(self, text))
    [example] = build_task(cfg.task, tiny.tokenizer, seed=0, max_context=16384).examples()
    assert example.n_tokens == 1024 and 0 < len(calls) < 2_000


def test_lazy_units_give_the_eager_haystack(tiny):
    from kvbench.tasks.haystack import Encoded, python_docs_prose
    from kvbench.tasks.niah import fill_haystack
    from kvbench.tasks.prompts import encode

    texts = [" " + s for s in python_docs_prose()[:300]]
    eager = [encode(tiny.tokenizer, t) for t in texts]
    for start, n in [(0, 500), (123, 2000), (299, 7000)]:
        lazy = Encoded(texts, lambda t: encode(tiny.tokenizer, t))
        assert fill_haystack(lazy, start, n) == fill_haystack(eager, start, n)
