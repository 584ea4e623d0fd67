"""The multi-step arithmetic task: its problems, its scoring, and rows whose trace length is the model's own."""

from omegaconf import OmegaConf

from kvbench.run.runner import run
from kvbench.tasks import build_task
from kvbench.tasks.arith import problem
from tests.conftest import CONF_DIR, compose_config


def _task(tiny, **overrides):
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "task" / "arith.yaml"), overrides)
    return build_task(cfg, tiny.tokenizer, seed=0)


def test_a_problem_chains_its_results_and_stays_positive():
    import random

    start, operands, results = problem(random.Random(3), 40)
    running = start
    for operand, result in zip(operands, results):
        running += operand
        assert result == running and result > 0 and 2 <= abs(operand) <= 49


def test_the_problem_is_the_context_and_the_instruction_is_appended(tiny):
    examples = _task(tiny, n_steps=[3, 8], n_problems=2).examples()
    assert [e.meta["n_steps"] for e in examples] == [3, 3, 8, 8] and len({e.example_id for e in examples}) == 4
    ex = examples[2]
    context, question = tiny.tokenizer.decode(ex.context_ids), tiny.tokenizer.decode(ex.question_ids)
    assert "Now this one:\nStart with" in context and "Answer: <number>" not in context
    assert question.startswith("Work it out step by step") and question.endswith("Step 1:")
    assert len(ex.answers) == 9 and ex.answers[0] == ex.answers[-1]  # the final value, then each step's result


def test_the_score_reads_the_first_answer_and_the_steps_written(tiny):
    ex = _task(tiny, n_steps=[3], n_problems=1).examples()[0]
    final, steps = ex.answers[0], ex.answers[1:]
    trace = "".join(f" x = {r}.\nStep:" for r in steps)
    task = _task(tiny)
    assert task.score(f"{trace}\nAnswer: {final}", ex) == {"score": 1.0, "score_partial": 1.0}
    assert task.score(f"{trace}\nAnswer: {int(final) + 1}\nAnswer: {final}", ex)["score"] == 0.0  # the first counts
    assert task.score(f" x = {steps[0]}. Answer:", ex) == {"score": 0.0, "score_partial": 1 / 3}


def test_rows_record_how_long_each_trace_is_against_the_full_cache(tmp_path):
    overrides = [
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        "report=false",
        f"results_dir={tmp_path / 'store'}",
        "task=arith",
        "task.n_steps=[4]",
        "task.n_problems=2",
        "task.max_new_tokens=24",
        "grid.method=[rkv,h2o]",
        "grid.budget=[0.25]",
    ]
    rows = run(compose_config(*overrides), output_dir=tmp_path / "out")
    assert len(rows) == 6 and set(rows.subset) == {"steps4"}
    full = rows[rows.method == "full"].set_index("example_id")
    assert (full.length_vs_full == 1.0).all()
    for _, row in rows[rows.method != "full"].iterrows():  # generated tokens over the full cache's on the example
        assert row.length_vs_full == row.new_tokens / full.loc[row.example_id, "new_tokens"]
