"""Offline haystack text: RULER's noise sentences, prose every Python install has, or the user's files.

A user's files are bounded: at most MAX_TEXT_BYTES in all (a prompt takes a few hundred KB of text; reading and
splitting a larger file is slow for nothing), text rather than binary bytes (checked through the whole of each),
and their sentences are tokenized only as a prompt takes them (`Encoded`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
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


MAX_TEXT_BYTES = 64 << 20  # the most haystack / perplexity text read from files (64 MiB ≈ 16M tokens)
SAMPLE_BYTES = 1 << 16  # the start of each file checked to be text


def binary_at(path: Path) -> int | None:
    """The offset of the first block (SAMPLE_BYTES) of `path` that is not text — a NUL byte, or more than 1 % of it
    not decodable as UTF-8 (a character split across blocks decodes whole: the decoder is incremental) — else None.
    The whole file is read: binary after a text start is still binary."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(SAMPLE_BYTES):
            undecodable = decoder.decode(block).count("\ufffd")
            if b"\x00" in block or undecodable > len(block) // 100:
                return offset
            offset += len(block)
    return offset if decoder.decode(b"", final=True).count("\ufffd") else None


def check_files(key: str, files) -> None:
    """`key` (a list of text files) is non-empty, every file exists and holds text, and all together are at most
    MAX_TEXT_BYTES."""
    if not files:
        raise KvbenchError(f"{key} is empty; give plain-text files: {key}=[path,...]")
    total = 0
    for path in files:
        p = Path(str(path)).expanduser()
        if not p.is_file():
            raise KvbenchError(f"{key}: {path} is not a file; fix the path in {key}=[...]")
        total += p.stat().st_size
        if total > MAX_TEXT_BYTES:
            break  # refused below without reading the rest
        offset = binary_at(p)
        if offset is not None:
            raise KvbenchError(
                f"{key}: {path} is not UTF-8 text (binary bytes at byte {offset:,}); give a plain-text "
                "file (a legacy encoding: iconv -t utf-8 FILE > FILE.txt)"
            )
    if total > MAX_TEXT_BYTES:
        raise KvbenchError(
            f"{key}: {total / (1 << 20):,.0f} MiB of text, above the {MAX_TEXT_BYTES >> 20} MiB kvbench reads (a "
            f"prompt takes a few hundred KB); give an excerpt, e.g. head -c {MAX_TEXT_BYTES >> 21}M FILE > part.txt"
        )


class Encoded(Sequence):
    """Text units tokenized on first use (each once): a long haystack costs only the units a prompt takes."""

    def __init__(self, texts: list[str], encode: Callable[[str], list[int]]):
        self.texts, self.encode = texts, encode
        self.ids: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i):  # type: ignore[override]  # integer indices only (fill_haystack's)
        if i not in self.ids:
            self.ids[i] = self.encode(self.texts[i])
        return self.ids[i]


def sentence_files(kind: str, files: list[str] | None = None) -> list[Path]:
    """The files `load_sentences(kind, files)` reads (their content goes into config_hash)."""
    if kind == "prose":
        import pydoc_data.topics

        return [Path(pydoc_data.topics.__file__)]  # differs between Python versions
    if kind == "file":
        return [Path(str(f)).expanduser() for f in files or []]
    return []


def load_sentences(kind: str, files: list[str] | None = None, key: str = "task.haystack_files") -> list[str]:
    if kind == "noise":
        return list(NOISE)
    if kind == "prose":
        return python_docs_prose()
    if kind == "file":
        if not files:
            raise KvbenchError(f"task.haystack=file needs {key}=[path, ...] (plain-text files)")
        check_files(key, files)
        sentences = []
        for path in files:
            p = Path(path).expanduser()
            sentences.extend(split_sentences(p.read_text(encoding="utf-8", errors="replace")))
        if not sentences:
            raise KvbenchError(f"haystack files {files} hold no sentences")
        return sentences
    raise KvbenchError(f"task.haystack={kind!r}: use noise, prose or file")
