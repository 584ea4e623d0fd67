"""End-to-end runs on the tiny model: ★ columns, baseline reuse, resume, atomic files, CLI multirun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench import KvbenchError
from kvbench.run.runner import run
from kvbench.store.results import COLUMNS, read_rows
from tests.conftest import compose_config, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_rows_carry_every_contract_column(tmp_path):
    rows = run(compose_config(*tiny_overrides(tmp_path)), output_dir=tmp_path / "out")
    assert set(COLUMNS) <= set(rows.columns)
    assert len(rows) == 4 * 2  # 2 lengths × 2 depths × (full baseline + streamingllm)
    assert set(rows.method) == {"full", "streamingllm"}
    assert rows.notna()[COLUMNS].all().all()
    assert (rows[rows.method == "full"].kv_ratio == 1.0).all()
    assert (rows[rows.method == "streamingllm"].kv_ratio < 0.6).all()
    assert rows.kv_bytes_full.gt(0).all() and rows.peak_mem_bytes.gt(0).all()
    assert json.loads(rows.method_params[rows.method == "streamingllm"].iloc[0])["start_size"] == 4
    assert all(isinstance(json.loads(a), list) for a in rows.answers)
    on_disk = pd.read_parquet(tmp_path / "out" / "rows.parquet")
    assert len(on_disk) == 8 and (tmp_path / "out" / "summary.csv").exists()
    assert len(read_rows(tmp_path / "store")) == 8
    assert not list((tmp_path / "store").rglob("*.tmp"))


def test_a_run_writes_its_plots_and_report(tmp_path, capsys):
    run(
        compose_config(*tiny_overrides(tmp_path, "report=true", "task.context_lengths=[700]")),
        output_dir=tmp_path / "out",
    )
    report = tmp_path / "out" / "report"
    assert (report / "report.html").stat().st_size > 0 and list(report.glob("heatmap_niah_*.png"))
    assert f"report:  {report / 'report.html'}" in capsys.readouterr().out


def test_second_run_reuses_rows_instead_of_recomputing(tmp_path):
    first = run(compose_config(*tiny_overrides(tmp_path)), output_dir=tmp_path / "a")
    # a different method: only its rows are new; the baseline comes from the store
    second = run(compose_config(*tiny_overrides(tmp_path, "budget=0.25")), output_dir=tmp_path / "b")
    assert second[second.method == "full"].reused.all()
    assert not second[second.method != "full"].reused.any()
    pd.testing.assert_series_equal(
        first[first.method == "full"].prediction.reset_index(drop=True),
        second[second.method == "full"].prediction.reset_index(drop=True),
    )
    third = run(compose_config(*tiny_overrides(tmp_path, "budget=0.25")), output_dir=tmp_path / "c")
    assert third.reused.all()


def test_interrupted_sweep_resumes(tmp_path, monkeypatch):
    import kvbench.run.runner as runner

    calls = {"n": 0}
    real_compressed = runner.Engine.compressed  # every configuration's compression, decoded alone or in a grid

    def failing_compressed(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # third example, first configuration
            raise KeyboardInterrupt
        return real_compressed(self, *args, **kwargs)

    monkeypatch.setattr(runner.Engine, "compressed", failing_compressed)
    overrides = tiny_overrides(tmp_path, "fidelity=false")  # one compression per configuration: no KL rebuilds
    with pytest.raises(KeyboardInterrupt):
        run(compose_config(*overrides), output_dir=tmp_path / "a")
    assert len(read_rows(tmp_path / "store")) == 4  # two finished examples × two configurations
    monkeypatch.setattr(runner.Engine, "compressed", real_compressed)
    rows = run(compose_config(*overrides), output_dir=tmp_path / "b")
    assert rows.reused.sum() == 4 and (~rows.reused).sum() == 4


def test_bad_inputs_are_one_clear_message(tmp_path):
    with pytest.raises(KvbenchError, match="more than the model's context"):
        run(compose_config(*tiny_overrides(tmp_path, "task.context_lengths=[20000]")), output_dir=tmp_path / "o")
    with pytest.raises(KvbenchError, match="budget=2.5"):
        run(compose_config(*tiny_overrides(tmp_path, "budget=2.5")), output_dir=tmp_path / "o")
    with pytest.raises(KvbenchError, match="kivi takes no budget.*method.bits"):
        run(compose_config(*tiny_overrides(tmp_path, "method=kivi", "budget=0.5")), output_dir=tmp_path / "o")
    with pytest.raises(KvbenchError, match="results_dir=PATH"):
        run(compose_config(*tiny_overrides(tmp_path, "results_dir=/proc/kvbench")), output_dir=tmp_path / "o")
    assert not list(tmp_path.rglob("*.parquet")) and not list(tmp_path.rglob("*.csv"))


def _cli(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_multirun_on_the_tiny_model(tmp_path):
    proc = _cli(
        [
            "-m",
            *tiny_overrides(tmp_path),
            "task.context_lengths=[700]",
            "task.depths=[0.5]",
            "method=full,streamingllm",
            "budget=0.5,0.25",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_rows(tmp_path / "store")
    assert sorted(set(zip(rows.method, rows.budget))) == [("full", 1.0), ("streamingllm", 0.25), ("streamingllm", 0.5)]
    assert len(list((tmp_path / "multirun").rglob("summary.csv"))) == 4


def test_cli_bad_input_exits_nonzero_with_the_fix(tmp_path):
    proc = _cli(
        [*tiny_overrides(tmp_path), "device=cuda"] if not _has_cuda() else [*tiny_overrides(tmp_path), "budget=0"],
        tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("kvbench: error:") == 1 and ("device=cpu" in proc.stderr or "budget" in proc.stderr)
    unknown = _cli([*tiny_overrides(tmp_path), "method=nope"], tmp_path)
    assert unknown.returncode != 0 and "streamingllm" in unknown.stderr


def _has_cuda():
    import torch

    return torch.cuda.is_available()


def _summary_printed(rows: list[dict], capsys) -> str:
    from types import SimpleNamespace

    from kvbench.run.runner import batches, print_summary
    from kvbench.store.aggregate import summarize

    frame = pd.DataFrame(rows)
    store = SimpleNamespace(rows_dir=Path("store/rows"))
    print_summary(summarize(frame), Path("out"), store, len(frame), 0, 1.0, batch=batches(frame))  # type: ignore[arg-type]
    return capsys.readouterr().out


def test_summary_labels_a_batch_step_and_says_when_n_is_too_small(capsys):
    from tests.report.test_report import row

    alone = [row(m, b, f"e{i}", 1.0, batch_size=1) for m, b in (("full", 1.0), ("snapkv", 0.5)) for i in range(3)]
    out = _summary_printed(alone, capsys)
    header = out.splitlines()[1].split()
    assert header[-1] == "decode_ms_per_token" and "batch_ms_per_step" not in out  # every row's own time
    assert out.count("n<5: no interval") == 2 and "nan" not in out.lower()
    together = [{**r, "batch_size": 2, "decode_ms_per_token": 25.0} for r in alone[:3] + alone[3:5]] + alone[5:]
    out = _summary_printed(together, capsys)
    header, full, snapkv = out.splitlines()[1:4]
    assert header.split()[-3:] == ["decode_ms_per_token", "batch_ms_per_step", "batch_size"]
    assert full.split()[-3:] == ["–", "25.000", "2"]  # the batch's step, never shown as full's own decode speed
    assert snapkv.split()[-3:] == ["–", "25.000", "1–2"]  # one example alone, two in a batch: a mixed mean
    assert "batch_ms_per_step: one decode step of a batch" in out


@pytest.mark.parametrize(
    ("arg", "line"),
    [
        ("output_dir=/tmp/x", "output_dir is not a kvbench setting: a run's directory is hydra.run.dir=PATH"),
        ("budgte=0.3", "budgte is not a kvbench setting; did you mean budget? the settings are listed in"),
    ],
)
def test_an_unknown_key_is_one_line_and_exit_2_before_hydra(arg, line, monkeypatch, capsys):
    from kvbench.__main__ import main

    monkeypatch.setattr(sys, "argv", ["kvbench", "model=tiny-random", arg])
    with pytest.raises(SystemExit) as stop:
        main()
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith(f"kvbench: error: {line}") and len(err.splitlines()) == 1


def test_known_keys_and_hydras_own_pass_the_key_check():
    from kvbench.__main__ import unknown_key

    given = ["-m", "budget=0.3", "task.context_lengths=[1]", "grid.method=[a]", "model=x", "+experiment=y", "~seed"]
    assert unknown_key([*given, "hydra.run.dir=/tmp/r", "decode_graph=true"]) is None
    # a Hydra group override and an experiment's own keys
    assert unknown_key(["hydra/launcher=submitit_local", "+experiment=serving", "serving.slo_tpot_s=9"]) is None
