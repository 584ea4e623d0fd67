"""shared_doc_qa: a LongBench-style document asked several questions (requests sharing the document), scored with
LongBench's official qa_f1_score; prefix caching keeps every output at fp32 on the tiny model."""

from __future__ import annotations

import random

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.run.runner import run
from kvbench.tasks import build_task
from kvbench.tasks.doc_qa import RELATIONS, draw_facts
from kvbench.tasks.longbench.config import PROMPTS
from tests.conftest import CONF_DIR, compose_config


def task_cfg(**overrides):
    cfg = OmegaConf.load(CONF_DIR / "task" / "shared_doc_qa.yaml")
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def examples(tiny):
    return build_task(task_cfg(questions=4, context_length=1500), tiny.tokenizer, seed=0).examples()


def test_requests_share_one_document_with_one_fact_each(examples, tiny):
    decode = tiny.tokenizer.decode
    assert len(examples) == 4
    assert all(ex.context_ids == examples[0].context_ids for ex in examples)  # the shared prefix
    assert all(len(ex.context_ids) == 1500 for ex in examples)  # the context length asked for, exactly
    document = decode(examples[0].context_ids)
    answers = [ex.answers[0] for ex in examples]
    assert len(set(answers)) == 4
    for ex in examples:
        assert document.count(ex.answers[0]) >= 1 and ex.evidence == (ex.answers[0],)
        question = decode(ex.question_ids)
        assert "Question: " in question and question.rstrip().endswith("assistant")
    assert [ex.meta["request_index"] for ex in examples] == [0, 1, 2, 3]
    assert {ex.meta["workload"] for ex in examples} == {"shared_doc_qa-d0"}
    # multifieldqa_en's template, verbatim, around the document: its text before and after {context}
    before, after = PROMPTS["multifieldqa_en"].split("{context}")
    full = decode(examples[0].context_ids + examples[0].question_ids)
    assert before in full and after.split("{input}")[0] in full
    assert full.count("\n\n\n") == 0  # the blank line before the document is not doubled


def test_facts_are_distinct_and_seeded():
    facts = draw_facts(random.Random("x"), 30)
    assert facts == draw_facts(random.Random("x"), 30)
    assert len({f.question for f in facts}) == 30 and len({f.answer.lower() for f in facts}) == 30
    # relations taken in turn: every relation is asked within the first len(RELATIONS) facts
    first = {f.text.split(" ")[1] for f in facts[: len(RELATIONS)]}
    assert len(first) > 1
    for f in facts:
        assert f.answer in f.text


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        ("Marrow River", "Marrow River", 1.0),
        ("The Marrow River.", "Marrow River", 1.0),  # articles and punctuation normalised away
        ("Ada", "Ada Fenwick", 2 / 3),  # precision 1, recall 1/2
        ("It was Ada Fenwick", "Ada Fenwick", 2 * (2 / 4) * 1 / (2 / 4 + 1)),  # precision 2/4, recall 1
        ("1858", "1859", 0.0),
    ],
)
def test_scores_are_longbench_qa_f1(examples, tiny, prediction, answer, expected):
    task = build_task(task_cfg(questions=4, context_length=1500), tiny.tokenizer, seed=0)
    ex = examples[0]
    ex = type(ex)(**{**vars(ex), "answers": [answer]})
    assert task.score(prediction, ex)["score"] == pytest.approx(expected)


def test_too_short_a_document_names_the_fix(tiny):
    with pytest.raises(KvbenchError, match="too short for 4 facts"):
        build_task(task_cfg(questions=4, context_length=300), tiny.tokenizer, seed=0).examples()


def test_prefix_cache_keeps_every_output_and_counts_reuse(tmp_path):
    common = [
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task=shared_doc_qa",
        "task.questions=3",
        "task.context_length=1200",
        "task.max_new_tokens=4",
        "grid.method=[snapkv,{name:kivi,group_size:16,residual_length:32}]",
        "grid.budget=[0.5]",
    ]
    plain = run(compose_config(*common), output_dir=tmp_path / "plain").sort_values(["request_index", "method"])
    cached = run(compose_config(*common, "prefix_cache=true"), output_dir=tmp_path / "cached").sort_values(
        ["request_index", "method"]
    )
    assert len(plain) == 3 * 3  # full + snapkv + kivi, 3 requests
    assert list(plain.prediction) == list(cached.prediction) and list(plain.score) == list(cached.score)
    assert set(plain.metric) == {"qa_f1_score"}
    assert (plain.reused_tokens == 0).all()
    assert (cached.prefill_tokens + cached.reused_tokens == plain.prefill_tokens).all()
    later = cached[cached.request_index > 0]
    assert (later.reused_tokens >= 1100).all() and (later.reused_tokens % 16 == 0).all()
