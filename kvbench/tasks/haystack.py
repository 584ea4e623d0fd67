"""Offline haystack text: RULER's noise sentences, prose every Python install has, or the user's files."""

from __future__ import annotations

import re
from pathlib import Path

from kvbench import KvbenchError

# RULER's "noise" haystack (hsiehjackson/RULER, synthetic niah): five sentences, repeated.
NOISE = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]

HAYSTACKS = ("noise", "prose", "file")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def split_sentences(text: str) -> list[str]:
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in _SENTENCE_END.split(text) if s]


def python_docs_prose() -> list[str]:
    """Prose paragraphs of the Python reference shipped with CPython (pydoc_data): ~400 KB of English text."""
    from pydoc_data.topics import topics

    sentences = []
    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            lines = paragraph.strip("\n").splitlines()
            # keep flowing prose: unindented lines, no headings, grammar rules or code
            if not lines or any(line.startswith((" ", "*", "=", "-", ">>>")) for line in lines):
                continue
            text = " ".join(lines)
            if len(text) > 80 and "::=" not in text:
                sentences.extend(split_sentences(text))
    return sentences


def check_files(key: str, files) -> None:
    """`key` (a list of text files) is non-empty and every file exists."""
    if not files:
        raise KvbenchError(f"{key} is empty; give plain-text files: {key}=[path,...]")
    for path in files:
        if not Path(str(path)).expanduser().is_file():
            raise KvbenchError(f"{key}: {path} is not a file; fix the path in {key}=[...]")


def sentence_files(kind: str, files: list[str] | None = None) -> list[Path]:
    """The files `load_sentences(kind, files)` reads (their content goes into config_hash)."""
    if kind == "prose":
        import pydoc_data.topics

        return [Path(pydoc_data.topics.__file__)]  # differs between Python versions
    if kind == "file":
        return [Path(str(f)).expanduser() for f in files or []]
    return []


def load_sentences(kind: str, files: list[str] | None = None) -> list[str]:
    if kind == "noise":
        return list(NOISE)
    if kind == "prose":
        return python_docs_prose()
    if kind == "file":
        if not files:
            raise KvbenchError("task.haystack=file needs task.haystack_files=[path, ...] (plain-text files)")
        sentences = []
        for path in files:
            p = Path(path).expanduser()
            if not p.is_file():
                raise KvbenchError(f"haystack file {p} does not exist")
            sentences.extend(split_sentences(p.read_text(encoding="utf-8", errors="replace")))
        if not sentences:
            raise KvbenchError(f"haystack files {files} hold no sentences")
        return sentences
    raise KvbenchError(f"task.haystack={kind!r}: use noise, prose or file")
