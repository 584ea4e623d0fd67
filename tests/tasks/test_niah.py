"""NIAH generation (lengths, needle placement, seeding) and scoring."""

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.tasks import build_task
from kvbench.tasks.metrics import partial_match, string_match
from tests.conftest import CONF_DIR


def _task(tokenizer, seed=0, **overrides):
    cfg = OmegaConf.load(CONF_DIR / "task" / "niah.yaml")
    cfg.update({"context_lengths": [1500, 3000], "depths": [0.0, 0.5, 1.0], **overrides})
    return build_task(cfg, tokenizer, seed)


def _find(haystack, needle):
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]


@pytest.mark.parametrize("haystack", ["noise", "prose"])
@pytest.mark.parametrize("value_type", ["digits", "words", "uuid"])
def test_examples_hit_the_length_and_hold_one_needle(tiny, haystack, value_type):
    task = _task(tiny.tokenizer, haystack=haystack, value_type=value_type)
    examples = task.examples()
    assert len(examples) == 6
    for ex in examples:
        target = ex.meta["length_target"]
        assert target * 0.98 <= ex.n_tokens <= target
        value = ex.answers[0]
        text = tiny.tokenizer.decode(ex.context_ids)
        assert text.count(value) == 1
        if value_type == "digits":
            assert len(value) == 7 and value.isdigit()
        # the needle sits at the requested depth of the context (± one sentence)
        haystack = text.split("afterwards.\n", 1)[1]
        where = haystack.index(value) / len(haystack)
        assert abs(where - ex.meta["depth"]) < 0.1
        assert "What is the special magic" in tiny.tokenizer.decode(ex.question_ids)


def test_examples_are_seeded(tiny):
    a, b, c = (
        _task(tiny.tokenizer, 0).examples(),
        _task(tiny.tokenizer, 0).examples(),
        _task(tiny.tokenizer, 1).examples(),
    )
    assert [e.context_ids for e in a] == [e.context_ids for e in b]
    assert [e.answers for e in a] != [e.answers for e in c]


def test_query_aware_split(tiny):
    ex = _task(tiny.tokenizer).examples()[0]
    assert ex.split(True) == (ex.context_ids + ex.question_ids, [])
    assert ex.split(False) == (ex.context_ids, ex.question_ids)


def test_user_haystack_file(tiny, tmp_path):
    path = tmp_path / "hay.txt"
    path.write_text("Alpha beta gamma. Delta epsilon zeta! Eta theta iota? " * 50)
    ex = _task(tiny.tokenizer, haystack="file", haystack_files=[str(path)]).examples()[0]
    assert "Delta epsilon zeta!" in tiny.tokenizer.decode(ex.context_ids)
    with pytest.raises(KvbenchError, match="haystack_files"):
        _task(tiny.tokenizer, haystack="file").examples()


def test_scoring():
    assert string_match(" The number is 1234567.", "1234567") == 1.0
    assert string_match(" 12345.", "1234567") == 0.0
    assert partial_match(" 12345.", "1234567") == pytest.approx(5 / 7)
    assert partial_match("nothing", "1234567") == 0.0
    assert partial_match("", "") == 0.0


def test_score_columns(tiny):
    task = _task(tiny.tokenizer)
    ex = task.examples()[0]
    assert task.score(f"is {ex.answers[0]}.", ex) == {"score": 1.0, "score_partial": 1.0}
    assert task.score(f"is {ex.answers[0][:4]}.", ex) == {"score": 0.0, "score_partial": pytest.approx(4 / 7)}
