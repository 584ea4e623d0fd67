"""Key-value retrieval (Lost in the Middle): the gold pair at the requested position, the paper's template."""

from omegaconf import OmegaConf

from kvbench.tasks import build_task
from kvbench.tasks.kv_retrieval import INSTRUCTION
from tests.conftest import CONF_DIR


def _task(tokenizer, seed=0, **overrides):
    cfg = OmegaConf.load(CONF_DIR / "task" / "kv_retrieval.yaml")
    cfg.update({"num_pairs": [6, 11], "positions": [0, 0.5, 1], "num_samples": 2, **overrides})
    return build_task(cfg, tokenizer, seed)


def test_gold_pair_sits_at_its_position_and_is_asked_for(tiny):
    examples = _task(tiny.tokenizer).examples()
    assert len(examples) == 2 * 3 * 2
    for ex in examples:
        context = tiny.tokenizer.decode(ex.context_ids)
        question = tiny.tokenizer.decode(ex.question_ids)
        records = context.split("JSON data:\n", 1)[1]
        lines = records.strip("{}").split(",\n ")
        assert len(lines) == ex.meta["num_pairs"] and INSTRUCTION in context
        key, value = lines[ex.meta["gold_index"]].replace('"', "").split(": ")
        assert value == ex.answers[0] and f'Key: "{key}"' in question and question.endswith("assistant\n")
        assert ex.meta["gold_index"] == round(ex.meta["depth"] * (ex.meta["num_pairs"] - 1))
        assert sum(line.count(value) for line in lines) == 1


def test_positions_move_the_same_pair_through_the_same_object(tiny):
    by_id = {ex.example_id: ex for ex in _task(tiny.tokenizer).examples()}
    first, last = by_id["kvr-N11-P0-i1-s0"], by_id["kvr-N11-P1-i1-s0"]
    assert first.answers == last.answers and first.context_ids != last.context_ids
    assert sorted(first.context_ids) == sorted(last.context_ids)  # the same tokens, reordered
    assert _task(tiny.tokenizer, seed=1).examples()[0].answers != _task(tiny.tokenizer).examples()[0].answers


def test_scores_exact_and_partial(tiny):
    task = _task(tiny.tokenizer)
    ex = task.examples()[0]
    value = ex.answers[0]
    assert task.score(f" {value}", ex) == {"score": 1.0, "score_partial": 1.0}
    cut = task.score(value[:18], ex)
    assert cut["score"] == 0.0 and 0 < cut["score_partial"] < 1
