"""RULER synthetic tasks on the byte tokenizer (1 token = 1 byte): lengths, one correct answer set per subtask,
seeding, scoring, bad input, and one offline run on the tiny model."""

import re
from collections import Counter

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.model.load import byte_tokenizer
from kvbench.run.runner import run
from kvbench.tasks import build_task
from kvbench.tasks.ruler_synthetic import SUBTASKS
from tests.conftest import CONF_DIR, compose_config

SHORT, LONG = 3100, 6800  # cwe switches to its 30/3 repetitions at 4096; at 30/3 the byte tokenizer needs ~6.4K
NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.")


def _task(tokenizer, seed=0, **overrides):
    cfg = OmegaConf.load(CONF_DIR / "task" / "ruler_synthetic.yaml")
    cfg.update({"context_lengths": [SHORT, LONG], "num_samples": 2, **overrides})
    return build_task(cfg, tokenizer, seed)


@pytest.fixture(scope="module")
def examples(tiny):
    return _task(tiny.tokenizer).examples()


def _texts(tiny, ex):
    return tiny.tokenizer.decode(ex.context_ids), tiny.tokenizer.decode(ex.question_ids)


def _of(examples, subset):
    return [ex for ex in examples if ex.subset == subset]


def test_every_subtask_fills_each_length(tiny, examples):
    assert len(examples) == len(SUBTASKS) * 2 * 2
    assert list(dict.fromkeys(ex.subset for ex in examples)) == list(SUBTASKS)
    generate = {"vt": 30, "cwe": 120, "fwe": 50}
    for ex in examples:
        target = ex.meta["length_target"]
        assert 0.98 * target <= ex.n_tokens <= target, ex.example_id
        assert re.fullmatch(rf"ruler_synthetic-{ex.subset}-L{target}-i[01]-s0", ex.example_id)
        assert ex.max_new_tokens == generate.get(ex.subset, 128)
        assert ex.meta["scenario"] == (
            "synthetic retrieval"
            if ex.subset.startswith("niah")
            else "multi-hop tracing"
            if ex.subset == "vt"
            else "aggregation"
        )
        context, question = _texts(tiny, ex)
        assert "Question" in question or "What" in question  # query_aware=false appends the question after
        assert question.endswith(("text is", "text are", "they are: ", "list are:", "words are:"))
        assert ex.split(False) == (ex.context_ids, ex.question_ids)
    assert all(0 <= ex.meta["depth"] <= 1 for ex in examples if ex.subset.startswith(("niah_single", "niah_multikey")))
    assert not any("depth" in ex.meta for ex in examples if ex.subset in ("niah_multivalue", "vt", "cwe"))


def _queried_keys(question):
    keys = re.search(r"for (.+) mentioned in the provided text\?", question).group(1)
    return re.split(r", and |, ", keys)


@pytest.mark.parametrize("subset", [n for n in SUBTASKS if n.startswith("niah")])
def test_niah_has_exactly_one_correct_answer_set(tiny, examples, subset):
    for ex in _of(examples, subset):
        context, question = _texts(tiny, ex)
        needles = NEEDLE.findall(context)
        queried = _queried_keys(question)
        real = [(k, v) for k, v in needles if k in queried]
        assert sorted(v for _, v in real) == sorted(ex.answers)
        for answer in ex.answers:
            assert context.count(answer) == 1
        if subset == "niah_multiquery":
            assert [dict(real)[k] for k in queried] == ex.answers and len(set(queried)) == 4
        elif subset == "niah_multivalue":
            assert len(queried) == 1 and len(real) == 4 and len(set(ex.answers)) == 4
        else:
            assert len(queried) == 1 and len(real) == 1 and len(ex.answers) == 1
            haystack = context.split("afterwards.\n", 1)[1]
            assert abs(haystack.index(ex.answers[0]) / len(haystack) - ex.meta["depth"]) < 0.1
        distractors = [k for k, _ in needles if k not in queried]
        if subset == "niah_multikey_1":
            assert len(distractors) == 3 and len(set(distractors)) == 3
        elif subset in ("niah_multikey_2", "niah_multikey_3"):
            assert len(distractors) > 10  # the haystack is needles with other keys
        else:
            assert not distractors
        if subset == "niah_multikey_3":
            assert re.fullmatch(r"[0-9a-f-]{36}", queried[0]) and re.fullmatch(r"[0-9a-f-]{36}", ex.answers[0])
        elif subset == "niah_single_3":
            assert re.fullmatch(r"[0-9a-f-]{36}", ex.answers[0])
        else:
            assert all(re.fullmatch(r"\d{7}", a) for a in ex.answers)


def _chains(text):
    """value -> every variable holding it, following `VAR B = VAR A` assignments."""
    holds = {}
    for name, source in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", text):
        holds[name] = holds[source[4:]] if source.startswith("VAR") else source
    chains = {}
    for name, value in holds.items():
        chains.setdefault(value, []).append(name)
    return chains


def test_vt_answers_are_the_queried_chain(tiny):
    examples = _task(tiny.tokenizer, tasks=["vt"], vt={"num_chains": 2, "num_hops": 4}).examples()
    for ex in examples:
        context, question = _texts(tiny, ex)
        example, task = context.rsplit("Memorize and track", 1)
        value = re.search(r"assigned the value (\d+)", question).group(1)
        chains = _chains(task)
        assert len(chains) == 2 and chains[value] == ex.answers and len(ex.answers) == 5
        (other,) = [names for v, names in chains.items() if v != value]
        assert not set(other) & set(ex.answers)
        assert all(len(name) == 3 for names in _chains(example).values() for name in names)  # RULER's solved example
        assert all(context.lower().count(a.lower()) == 1 + (a != ex.answers[-1]) for a in ex.answers)


def test_cwe_common_words_are_the_answers(tiny, examples):
    for ex in _of(examples, "cwe"):
        context, _ = _texts(tiny, ex)
        example, task = context.rsplit("Memorize the ones that appear most often.\n", 1)
        entries = re.findall(r"(\d+)\. (\w+)", task)
        assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(word for _, word in entries)
        common, other = (30, 3) if ex.meta["length_target"] >= 4096 else (6, 1)  # RULER's short-context counts
        assert all(counts[word] == common for word in ex.answers) and len(ex.answers) == 10
        assert {n for word, n in counts.items() if word not in ex.answers} == {other}
        assert not set(counts) & set(re.findall(r"\d+\. (\w+)", example))  # the solved example's words differ


def test_fwe_answers_are_strictly_most_frequent(tiny, examples):
    for ex in _of(examples, "fwe"):
        context, _ = _texts(tiny, ex)
        words = context.split("coded words. ", 1)[1].split()
        counts = Counter(w for w in words if w != "...")
        ranked = [n for _, n in counts.most_common()]
        assert sorted(ex.answers) == sorted(w for w, _ in counts.most_common(3))
        assert min(counts[a] for a in ex.answers) > ranked[3]
        assert all(re.fullmatch(r"[a-z]{6}", a) for a in ex.answers)


def test_examples_are_seeded_and_independent_of_the_selection(tiny, examples):
    again = _task(tiny.tokenizer).examples()
    other_seed = _task(tiny.tokenizer, seed=1).examples()
    assert [(e.context_ids, e.question_ids, e.answers) for e in again] == [
        (e.context_ids, e.question_ids, e.answers) for e in examples
    ]
    assert all(a.answers != b.answers for a, b in zip(examples, other_seed))
    alone = _task(tiny.tokenizer, tasks=["vt"], context_lengths=[LONG], num_samples=1).examples()[0]
    (same,) = [e for e in examples if e.example_id == alone.example_id]
    assert alone.context_ids == same.context_ids and alone.answers == same.answers


def test_tokenizers_without_a_chat_template_get_the_bare_task_text():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    for ex in _task(tokenizer, tasks=["niah_single_1", "cwe"], context_lengths=[SHORT], num_samples=1).examples():
        context, question = tokenizer.decode(ex.context_ids), tokenizer.decode(ex.question_ids)
        assert 0.98 * SHORT <= ex.n_tokens <= SHORT and "<|im_start|>" not in context + question
        assert context.startswith(("A special magic number is hidden", "Below is a numbered list"))
        if ex.subset == "cwe":  # RULER's base template: the solved example, then the task on the next line
            assert context.count("Below is a numbered list") == 2 and "are: 1. " in context


def test_scoring_is_ruler_string_match_all(tiny, examples):
    task = _task(tiny.tokenizer)
    assert task.metric == "string_match_all"
    ex = _of(examples, "niah_multivalue")[0]
    a, b, c, d = ex.answers
    assert task.score(f"{a}, {b}, {c} and {d}.", ex) == {"score": 1.0}
    assert task.score(f"{d} {b}", ex) == {"score": 0.5}
    assert task.score("no idea", ex) == {"score": 0.0}
    uuid = _of(examples, "niah_single_3")[0]
    assert task.score(uuid.answers[0].upper(), uuid) == {"score": 1.0}  # case-insensitive, as RULER


def test_generation_lengths_can_be_capped(tiny):
    examples = _task(tiny.tokenizer, tasks=["niah_single_1", "vt"], max_new_tokens=40).examples()
    assert {ex.subset: ex.max_new_tokens for ex in examples} == {"niah_single_1": 40, "vt": 30}


def test_bad_input_is_one_clear_message(tiny):
    with pytest.raises(KvbenchError, match="valid subtasks: niah_single_1, .*, fwe"):
        _task(tiny.tokenizer, tasks=["niah_single_1", "qa_1"]).examples()
    with pytest.raises(KvbenchError, match="too short for RULER's cwe"):
        _task(tiny.tokenizer, tasks=["cwe"], context_lengths=[500]).examples()
    with pytest.raises(KvbenchError, match="task.vt has no parameter 'hops'"):
        _task(tiny.tokenizer, tasks=["vt"], vt={"hops": 2}).examples()
    with pytest.raises(KvbenchError, match="alpha"):
        _task(tiny.tokenizer, tasks=["fwe"], fwe={"alpha": 1.0}).examples()


def test_offline_run_on_the_tiny_model(tmp_path):
    cfg = compose_config(
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "task=ruler_synthetic",
        "task.context_lengths=[3000]",
        "task.num_samples=1",
        "task.tasks=[niah_single_1,vt]",
        "task.max_new_tokens=4",
    )
    rows = run(cfg, output_dir=tmp_path / "out")
    assert len(rows) == 2 * 2  # 2 examples × (full baseline + the default method)
    assert set(rows.subset) == {"niah_single_1", "vt"} and set(rows.metric) == {"string_match_all"}
    assert rows.score.between(0, 1).all() and (rows.length_target == 3000).all()
    assert set(rows.scenario) == {"synthetic retrieval", "multi-hop tracing"}
    assert rows[rows.subset == "niah_single_1"].depth.notna().all()
