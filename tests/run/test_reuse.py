"""Reused rows are never stale: config_hash includes the content of every data file a task reads, and every row
records the code that computed it (a mismatch is reported)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.run.runner import run
from kvbench.store.results import code_fingerprint, file_digest
from kvbench.tasks.longbench import LongBench
from tests.conftest import CONF_DIR, compose_config, tiny_overrides

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "longbench"


def _haystack_run(tmp_path, out: str):
    overrides = tiny_overrides(
        tmp_path,
        "method=full",
        "task.haystack=file",
        f"task.haystack_files=[{tmp_path / 'hay.txt'}]",
        "task.context_lengths=[500]",
        "task.depths=[0.5]",
        "task.max_new_tokens=3",
    )
    return run(compose_config(*overrides), output_dir=tmp_path / out)


def test_editing_a_haystack_file_recomputes_its_rows(tmp_path):
    (tmp_path / "hay.txt").write_text("The river runs north. " * 40)
    first = _haystack_run(tmp_path, "a")
    again = _haystack_run(tmp_path, "b")
    assert not first.reused.any() and again.reused.all()
    (tmp_path / "hay.txt").write_text("The river runs south. " * 40)  # same path, same size, new content
    edited = _haystack_run(tmp_path, "c")
    assert not edited.reused.any()
    assert set(edited.config_hash).isdisjoint(first.config_hash)


def _longbench(data_dir: Path) -> LongBench:
    cfg = OmegaConf.merge(
        OmegaConf.load(CONF_DIR / "task" / "longbench.yaml"), {"data_dir": str(data_dir), "subsets": ["hotpotqa"]}
    )
    return LongBench(cfg, tokenizer=None, seed=0)


def test_longbench_fingerprint_follows_file_content_not_the_selection(tmp_path):
    shutil.copytree(FIXTURES, tmp_path / "lb")
    task = _longbench(tmp_path / "lb")
    files = task.data_files()
    assert tmp_path / "lb" / "hotpotqa.jsonl" in files and tmp_path / "lb" / "qasper.jsonl" in files
    before = {str(p): file_digest(p) for p in files}
    path = tmp_path / "lb" / "qasper.jsonl"
    path.write_text(path.read_text().replace('"answers": [', '"answers": ["edited", ', 1))
    after = {str(p): file_digest(p) for p in _longbench(tmp_path / "lb").data_files()}
    assert [k for k in before if before[k] != after[k]] == [str(path)]


def test_every_row_records_its_code_and_a_mismatch_is_reported(tmp_path, monkeypatch, capsys):
    import kvbench.run.runner as runner

    first = run(compose_config(*tiny_overrides(tmp_path, "task.context_lengths=[500]")), output_dir=tmp_path / "a")
    assert (first.code_fingerprint == code_fingerprint()).all() and len(code_fingerprint()) == 16
    capsys.readouterr()
    monkeypatch.setattr(runner, "code_fingerprint", lambda: "0123456789abcdef")  # as if the sources had changed
    second = run(compose_config(*tiny_overrides(tmp_path, "task.context_lengths=[500]")), output_dir=tmp_path / "b")
    assert second.reused.all()
    out = capsys.readouterr().out
    assert f"note: {len(second)} of the {len(second)} reused rows were computed by different kvbench code" in out
    assert "rerun=true to recompute" in out


def selections() -> list[tuple[list[str], list[str]]]:
    """(task overrides, the same with every selection key narrowed) for each registered task with selection keys,
    derived from the task's `selection_keys` and its conf/task/<name>.yaml: each list-valued key cut to its first
    two values (fast, and away from each list's most demanding end), then to the second of them; each count (an
    int key, or a null one declared int: every record) to 1. A task reading data files reads tests/fixtures/<name>/
    as its `data_dir`. A task whose defaults select nothing ([], lm_eval's tasks) is tested elsewhere."""
    from kvbench.preflight.entrance import task_rule
    from kvbench.tasks import TASKS

    out = []
    for name in TASKS.names():
        task_cls = TASKS.get(name)
        defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "task" / f"{name}.yaml"))
        keys = sorted(task_cls.selection_keys)
        if not keys or any(defaults.get(key) == [] for key in keys):
            continue
        fixture = FIXTURES.parent / name
        wide = [f"task={name}"] + ([f"task.data_dir={fixture}"] if "data_dir" in defaults and fixture.is_dir() else [])
        narrow = list(wide)
        for key in keys:
            value = defaults.get(key)
            rule = task_rule(name, key, value, dict(task_cls.knobs))
            if isinstance(value, list) and len(value) > 1:
                wide.append(f"task.{key}=[{value[0]},{value[1]}]")
                narrow.append(f"task.{key}=[{value[1]}]")
            elif rule is not None and rule.kind == "int":
                narrow.append(f"task.{key}=1")
        out.append((wide, narrow))
    return out


SELECTIONS = selections()


@pytest.mark.parametrize("wide,narrow", SELECTIONS, ids=[s[0][0] for s in SELECTIONS])
def test_selection_keys_only_select(tiny, wide, narrow):
    """A task's `selection_keys` are left out of config_hash, so narrowing them must pick a subset of the same
    examples, token for token (otherwise reused rows would answer a different prompt)."""
    from kvbench.tasks import TASKS, build_task

    def examples(overrides):
        cfg = compose_config(*overrides)
        changed = {k.split("=")[0].removeprefix("task.") for k in overrides} - {"task"}
        task_cls = TASKS.get(cfg.task.name)
        assert {k for k in changed if k not in ("data_dir", "max_length")} <= task_cls.selection_keys
        task = build_task(cfg.task, tiny.tokenizer, 0, tiny.max_context)
        return {ex.example_id: (ex.context_ids, ex.question_ids, ex.answers) for ex in task.examples()}

    all_examples, some = examples(wide), examples(narrow)
    assert some and set(some) < set(all_examples)
    assert all(some[k] == all_examples[k] for k in some)


def test_the_data_key_follows_content_not_where_the_files_live(tmp_path):
    """The same data in another folder (another checkout, venv or machine) keys the same rows; an edit does not."""
    from kvbench.store.results import data_digests

    shutil.copytree(FIXTURES, tmp_path / "one")
    shutil.copytree(FIXTURES, tmp_path / "two")
    one, two = (data_digests(_longbench(tmp_path / d).data_files()) for d in ("one", "two"))
    assert one == two and ("qasper.jsonl", file_digest(tmp_path / "one" / "qasper.jsonl")) in one
    path = tmp_path / "two" / "qasper.jsonl"
    path.write_text(path.read_text().replace('"answers": [', '"answers": ["edited", ', 1))
    assert data_digests(_longbench(tmp_path / "two").data_files()) != one
