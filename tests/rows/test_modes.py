"""kvbench.rows.modes: the one table of run modes — the docs show it, every conflict is one line naming both modes,
and the hash keys the active modes add are what rows of those modes were always keyed by."""

from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.config.spec import RunSpec
from kvbench.methods import build_method
from kvbench.rows import modes
from kvbench.rows.modes import CONFLICTS, MODES, NEEDS, WHEN, RunFacts
from kvbench.tasks import TASKS

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_show_the_table():
    assert modes.markdown() in (ROOT / "docs" / "cli.md").read_text(), (
        "paste kvbench.rows.modes.markdown() into docs/cli.md"
    )


def test_every_mode_is_described_and_every_rule_names_known_modes():
    assert set(WHEN) == set(MODES)
    for a, b, why in CONFLICTS:
        assert a in MODES and b in MODES and why.strip() and "\n" not in why
    for mode, (needed, _) in NEEDS.items():
        assert mode in MODES and needed in MODES


# a RunFacts in which exactly the named mode is active
SETTINGS = {
    "inline": {"prefill": "inline"},
    "chunked": {"prefill": "inline", "prefill_chunk": 64},
    "prefix_cache": {"prefix_cache": True},
    "compress_once": {"prefix_cache": True, "reuse": "compress_once"},
    "batch": {"batch_size": 4},
    "diagnose": {"diagnose": True},
    "engine": {"engine": {"name": "llamacpp"}},
    "context_only": {"query_aware": False},
}
TASK_OF = {"stream": "ppl", "workload": "shared_doc", "external": "lm_eval"}
METHOD_OF = {"whole_prefill_method": "kvzip", "chunk_limited_method": "adakv"}


def facts_with(*keys: str) -> RunFacts:
    spec = RunSpec(task={"name": "niah"})
    task, methods, sliding, hybrid = TASKS.get("niah"), [build_method("snapkv")], False, False
    for key in keys:
        spec = replace(spec, **SETTINGS.get(key, {}))
        task = TASKS.get(TASK_OF[key]) if key in TASK_OF else task
        methods += [build_method(METHOD_OF[key])] if key in METHOD_OF else []
        sliding = sliding or key == "sliding"
        hybrid = hybrid or key == "hybrid"
    return RunFacts(spec, task, tuple(methods), sliding, hybrid)


@pytest.mark.parametrize("a,b,why", [c for c in CONFLICTS if "hooked" not in c[:2]], ids=lambda v: str(v)[:20])
def test_every_conflict_is_one_line_naming_both_modes(a, b, why):
    facts = facts_with(a, b)
    assert {a, b} <= set(modes.active(facts)), modes.active(facts)
    message = modes.refusal(facts)
    assert message and "\n" not in message
    named = [
        MODES[m].label(facts) in message or (m in NEEDS and MODES[NEEDS[m][0]].label(facts) in message) for m in (a, b)
    ]
    assert all(named), message  # a mode that needs another may be refused through the one it needs
    assert modes.refusal(facts_with(a)) is None or a in NEEDS  # each alone runs


def test_a_mode_missing_what_it_needs_is_refused():
    assert "needs prefill=inline" in modes.refusal(RunFacts(RunSpec(prefill_chunk=64), TASKS.get("niah")))
    assert "add prefix_cache=true" in modes.refusal(RunFacts(RunSpec(reuse="compress_once"), TASKS.get("niah")))


def test_hash_keys_are_the_rows_keys_of_each_mode():
    niah = TASKS.get("niah")
    assert modes.hash_keys(RunSpec(), niah) == {}
    assert modes.hash_keys(RunSpec(prefill="inline", prefill_chunk=64), niah) == {
        "prefill": "inline",
        "prefill_chunk": 64,
    }
    assert modes.hash_keys(RunSpec(batch_size=2), niah) == {"batch_size": 2}
    assert modes.hash_keys(RunSpec(prefix_cache=True, page_size=1), niah) == {
        "prefix_cache": True,
        "reuse": "per_question",
        "page_size": 1,
        "prefix_cache_bytes": None,
    }
    # a workload task without the prefix cache runs its requests in order but hashes as before (no prefix keys)
    shared = TASKS.get("shared_doc")
    assert modes.hash_keys(RunSpec(), shared) == {} and modes.requests_in_order(RunFacts(RunSpec(), shared))


def test_batched_only_for_generation_tasks():
    assert modes.batched(RunFacts(RunSpec(batch_size=2), TASKS.get("niah")))
    assert not modes.batched(RunFacts(RunSpec(), TASKS.get("niah")))
