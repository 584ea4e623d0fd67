"""kvbench as an lm-evaluation-harness model and the `lm_eval` task, offline on the tiny random model:
at the full cache every answer equals lm-eval's own `hf` model on the same weights; compression changes answers,
shrinks the cache, and a shared prefill gives each configuration the answers it gets alone."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the fixture tasks read local files; never reach a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval import evaluator
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from kvbench import KvbenchError
from kvbench.integrations.lm_eval_model import KvbenchLM, from_model_args
from kvbench.native.engine import Engine
from kvbench.rows.configuration import make_configuration
from kvbench.run.runner import run
from kvbench.store.results import COLUMNS
from tests.conftest import compose_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = "tests/fixtures/lm_eval"  # the tasks' data_files are relative to the repository root
TASKS = ["kvbench_qa", "kvbench_mc"]
LIMIT = 2


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    """The tiny random model saved as a transformers directory, so lm-eval's `hf` loads the same weights."""
    path = tmp_path_factory.mktemp("tiny-hf")
    tiny.model.save_pretrained(path)
    tiny.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def in_repo_root():
    cwd = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(cwd)


def evaluate(lm) -> dict:
    tasks = TaskManager(include_path=FIXTURES, include_defaults=False).load(TASKS)
    return evaluator.evaluate(lm, tasks, limit=LIMIT, bootstrap_iters=0, log_samples=True)


@pytest.fixture(scope="module")
def hf_results(tiny_dir):
    from lm_eval.models.huggingface import HFLM

    return evaluate(HFLM(pretrained=str(tiny_dir), dtype="float32", device="cpu", batch_size=1))


def kv_lm(tiny_dir, **args) -> KvbenchLM:
    return from_model_args({"pretrained": str(tiny_dir), "dtype": "float32", "device": "cpu", **args})


def test_full_cache_equals_hf(tiny_dir, hf_results):
    ours = evaluate(kv_lm(tiny_dir))
    for task in TASKS:
        hf_metrics = {k: v for k, v in hf_results["results"][task].items() if "stderr" not in k}
        assert {k: v for k, v in ours["results"][task].items() if "stderr" not in k} == hf_metrics
        for theirs, mine in zip(hf_results["samples"][task], ours["samples"][task], strict=True):
            assert mine["doc_id"] == theirs["doc_id"]
            if task == "kvbench_qa":
                assert mine["resps"] == theirs["resps"]  # generated text, character for character
            else:
                for [(lp_hf, greedy_hf)], [(lp, greedy)] in zip(theirs["resps"], mine["resps"], strict=True):
                    assert lp == pytest.approx(lp_hf, abs=1e-4) and greedy == greedy_hf
    generated = [s["resps"][0][0] for s in ours["samples"]["kvbench_qa"]]
    assert any(generated), "the comparison must cover non-empty generations"


def test_rolling_streams_like_hf_at_full_cache(tiny_dir, hf_results):
    from lm_eval.models.huggingface import HFLM

    text = "A long text streams through the cache, chunk after chunk, and each token is scored once. " * 4
    requests = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    hf = HFLM(pretrained=str(tiny_dir), dtype="float32", device="cpu", batch_size=1).loglikelihood_rolling(requests)
    full = kv_lm(tiny_dir, chunk=64)  # ~360 byte tokens: six chunks through one growing cache
    assert full.loglikelihood_rolling(requests)[0] == pytest.approx(hf[0], abs=1e-3)
    bounded = kv_lm(tiny_dir, chunk=64, method="streamingllm", budget=96)
    [answer] = bounded.rolling_answers(requests)[0]
    assert answer.value != pytest.approx(hf[0], abs=1e-3)
    assert answer.kv_bytes < 0.5 * answer.kv_bytes_full  # 96 + at most one chunk held, of ~360 tokens


def test_shared_prefill_answers_equal_each_configuration_alone(tiny, tiny_dir):
    tasks = TaskManager(include_path=FIXTURES, include_defaults=False).load(["kvbench_mc"])["tasks"]
    task = tasks["kvbench_mc"]
    task.build_all_requests(limit=1)
    requests = task.instances  # 4 choices of one question: one context
    confs = [
        make_configuration({"name": "full"}, 1.0, True),
        make_configuration({"name": "snapkv"}, 0.3, True),
        make_configuration({"name": "streamingllm"}, 0.3, True),
    ]
    together = KvbenchLM(Engine(tiny), confs).loglikelihood_answers(requests)
    for k, c in enumerate(confs):
        alone = KvbenchLM(Engine(tiny), [c]).loglikelihood_answers(requests)
        assert [a[k].value for a in together] == [a[0].value for a in alone]
    full, snapkv = [a[0] for a in together], [a[1] for a in together]
    assert all(0.25 < s.kv_bytes / s.kv_bytes_full < 0.35 for s in snapkv)  # ~0.3 of a ~600-token context
    assert all(f.kv_bytes == f.kv_bytes_full for f in full)
    assert [f.value for f in full] != [s.value for s in snapkv]
    assert sum(a.prefill_s > 0 for a in full) >= 1  # the prefill is charged once, to the first choice


def test_bad_model_args_say_what_to_fix(tiny_dir):
    with pytest.raises(KvbenchError, match="question_tokens"):
        kv_lm(tiny_dir, query_aware=False)
    with pytest.raises(KvbenchError, match="no parameter 'windowsize'"):
        kv_lm(tiny_dir, method="snapkv", windowsize=8)
    with pytest.raises(KvbenchError, match="no such kvbench model"):
        from_model_args({"model": "nope"})
    lm = kv_lm(tiny_dir)
    with pytest.raises(KvbenchError, match="greedily"):
        lm.generate_until([Instance("generate_until", {}, ("Hi", {"do_sample": True, "temperature": 0.7}), 0)])


def test_task_rows_match_hf_per_document(tmp_path, hf_results):
    overrides = [
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task=lm_eval",
        f"task.tasks={TASKS}",
        f"task.include_path={FIXTURES}",
        "task.include_defaults=false",
        f"task.limit_per_task={LIMIT}",
        "grid.method=[snapkv]",
        "grid.budget=[0.5]",
    ]
    rows = run(compose_config(*overrides), output_dir=tmp_path / "run")
    assert set(rows.metric) == {"exact_match,strip", "acc,none", "acc_norm,none"}
    assert set(rows.subset) == {"kvbench_qa/exact_match,strip", "kvbench_mc/acc,none", "kvbench_mc/acc_norm,none"}
    assert len(rows) == 2 * LIMIT * 3  # full + snapkv × LIMIT documents × (1 + 2 metric rows)
    full = rows[rows.method == "full"].set_index("example_id")
    for task in TASKS:  # the same weights as hf's directory (tiny-random is built from the same seed)
        for sample in hf_results["samples"][task]:
            for metric in sample["metrics"]:
                row_id = f"{task}/{sample['doc_id']}/{metric},{sample['filter']}"
                assert full.loc[row_id, "score"] == sample[metric]
    snapkv = rows[rows.method == "snapkv"]
    assert (snapkv.kv_ratio < 0.6).all() and (full.kv_ratio == 1.0).all()
    assert (rows.context_tokens > 500).all() and rows.prefill_s.notna().all()
    assert set(COLUMNS) <= set(rows.columns)
    again = run(compose_config(*overrides), output_dir=tmp_path / "run2")  # every row comes from the store
    assert again.reused.all() and len(again) == len(rows)


def test_task_unknown_name_is_one_clear_error(tmp_path):
    cfg = compose_config(
        "model=tiny-random",
        "device=cpu",
        "task=lm_eval",
        "task.tasks=[no_such_task]",
        f"task.include_path={FIXTURES}",
        "task.include_defaults=false",
        f"results_dir={tmp_path}",
        "report=false",
    )
    with pytest.raises(KvbenchError, match="unknown lm-eval task"):
        run(cfg, output_dir=tmp_path / "run")


def test_console_script_runs_lm_eval_with_the_kvbench_model(tiny_dir, tmp_path, monkeypatch, capsys):
    from importlib.metadata import entry_points

    from kvbench.integrations.lm_eval_cli import main

    [script] = [e for e in entry_points(group="console_scripts") if e.name == "kvbench-lm-eval"]
    assert script.value == "kvbench.integrations.lm_eval_cli:main"
    base = [
        "kvbench-lm-eval",
        "--model",
        "kvbench",
        "--tasks",
        "kvbench_mc",
        "--include_path",
        FIXTURES,
        "--limit",
        "1",
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "out"),
    ]  # lm-eval's own arguments
    monkeypatch.setattr(
        sys, "argv", base + ["--model_args", f"pretrained={tiny_dir},method=snapkv,budget=0.5,dtype=float32"]
    )
    main()  # in-process: the console script's function, without a second interpreter's imports
    [results] = list((tmp_path / "out").rglob("results_*.json"))
    assert json.loads(results.read_text())["results"]["kvbench_mc"]["acc,none"] in (0.0, 1.0)
    monkeypatch.setattr(sys, "argv", base + ["--model_args", f"pretrained={tiny_dir},method=snapkv,budget=1.5"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("kvbench-lm-eval: error: budget=1.5")


def test_console_script_unknown_task_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from kvbench.integrations.lm_eval_cli import main

    argv = ["kvbench-lm-eval", "--model", "kvbench", "--model_args", "model=tiny-random,device=cpu"]
    monkeypatch.setattr(sys, "argv", argv + ["--tasks", "no_such_task", "--include_path", FIXTURES])
    with pytest.raises(SystemExit) as exited:  # before: lm-eval's ValueError traceback, exit 1
        main()
    assert exited.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("kvbench-lm-eval: error: Tasks not found: no_such_task; list them with `lm-eval ls tasks`")


def test_task_include_path_that_does_not_exist_is_refused_before_the_model_loads(tmp_path):
    from kvbench.preflight.entrance import check_config

    cfg = compose_config("model=tiny-random", "task=lm_eval", "task.tasks=[x]", f"task.include_path={tmp_path}/no")
    with pytest.raises(KvbenchError, match=r"task\.include_path=.* does not exist"):
        check_config(cfg)


# (class, --model_args as lm-eval types them, --batch_size, text of the one line)
MODEL_ARG_CASES = [
    ("type", {"budget": "abc"}, None, "budget=abc is not a number; use budget=0.5"),
    ("type", {"query_aware": "maybe"}, None, "query_aware=true or query_aware=false"),
    ("type", {"max_length": 1.5}, None, "max_length=4096"),
    ("range", {"budget": 1.5}, None, "must be an integer"),
    ("range", {"max_gen_toks": 0}, None, "max_gen_toks=256"),
    ("range", {"dtype": "int8"}, None, "dtype=auto"),
    ("huge integer", {"chunk": 10**30}, None, "too large"),
    ("method knob", {"method": "snapkv", "window_size": "x"}, None, "window_size=32"),
    ("method knob", {"method": "snapkv", "windowsize": 8}, None, "valid parameters"),
    ("method knob", {"method": "nope"}, None, "valid methods"),
    ("model", {"model": "nope"}, None, "no such kvbench model"),
    ("ignored batch", {}, "8", "--batch_size 8 has no effect"),
    ("ignored batch", {"batch_size": 4}, None, "batch_size=4 has no effect"),
]


@pytest.mark.parametrize("kind,model_args,batch,fix", MODEL_ARG_CASES, ids=[c[0] + str(c[1]) for c in MODEL_ARG_CASES])
def test_model_args_are_checked_before_lm_eval_runs(kind, model_args, batch, fix):
    from kvbench.integrations.lm_eval_cli import check_model_args

    with pytest.raises(KvbenchError) as error:
        check_model_args({"model": "tiny-random", **model_args}, batch)
    assert fix in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_good_model_args_pass():
    from kvbench.integrations.lm_eval_cli import check_model_args

    check_model_args(
        {"model": "tiny-random", "method": "snapkv", "budget": 0.5, "window_size": 8, "model.init_seed": 1}
    )
    check_model_args({"pretrained": "some/hub-id", "query_aware": False, "question_tokens": 8}, "1")
