"""Every benchmark of kvbench.bench beyond sweep/decode/stats (tests/bench/test_bench.py): each runs on the tiny model
where it can without an engine's venv or a GPU and prints its figures; a bad option or override is one line and exit
2, before anything loads; the registry names a module with a `main` and a docstring for each."""

from __future__ import annotations

import importlib
import json
import re

import pytest
import torch

from kvbench.bench import ALL, BENCHMARKS
from kvbench.bench.__main__ import main

TINY = ["model=tiny-random", "device=cpu", "dtype=float32"]
SHORT = [*TINY, "task.context_lengths=[300]"]
NIAH = [*TINY, "task.context_lengths=[600]", "task.depths=[0.5]", "task.max_new_tokens=4"]


def run(argv: list[str], capsys, code: int = 0) -> str:
    assert main(argv) == code
    return capsys.readouterr().out


def test_every_benchmark_is_a_module_with_main_and_help():
    for name, module in BENCHMARKS.items():
        loaded = importlib.import_module(module)
        assert callable(loaded.main) and loaded.__doc__ and name in loaded.__doc__, name
    assert set(ALL) <= set(BENCHMARKS)


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["engine", "bench.nope=1"],
            r"engine has no option bench.nope; its options: bench.dtypes, bench.decode_tokens",
        ),
        (["peak_memory", "bench.context=many"], r"bench.context=many is not a number; e.g. bench.context=8192"),
        (["decode_methods", "bench.repeats=1.5"], r"bench.repeats=1.5 is not an integer"),
        (["decode_methods", "dtype=float8"], r"dtype=float8 is not one of"),
        (
            ["peak_memory", *TINY, "grid.method=[full]", "bench.modes=[sideways]"],
            r"bench.modes=\['sideways'\]: use shared, inline",
        ),
        (
            ["throughput", *TINY, "grid.method=[snapkv]", "bench.hardware=abacus"],
            r"no conf/hardware/abacus.yaml; presets: .*h200",
        ),
        (["prefix", *TINY, "bench.workloads=[chat]"], r"no workload 'chat'; choose among shared_doc"),
        (["cpu_kernels", *TINY, "bench.clock=sundial"], r"bench.clock=wall\|cpu"),
        (["kernels", "device=cpu"], r"the Triton kernels run on CUDA"),
        (["engine_parity", *TINY], r"give the serving engine to compare: engine=llamacpp"),
        (["engine_options", *TINY, "bench.x=1"], r"engine_options has no option bench.x; its options: none"),
        (["compare_reuse"], r"compare_reuse needs bench.per_question=\.\.\."),
        (["compare_reuse", "model=tiny-random"], r"compare_reuse takes only its own options .* not model=tiny-random"),
        (["methods2026", "bench.task=longbench"], r"bench.task=longbench: the tables are bench.task=niah or"),
        (["diagnose_evidence", "bench.results"], r"bench.results needs a value"),
        (["h2o_mass", *TINY, "budget=2.5"], r"budget"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, line, capsys):
    assert main(argv) == 2
    out = capsys.readouterr()
    assert re.search(line, out.err) and "Traceback" not in out.err, out.err
    assert len(out.err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device here: the GPU benchmarks would run")
@pytest.mark.parametrize("name", ["gpu", "fidelity_reuse", "kernels"])
def test_the_gpu_benchmarks_refuse_a_cpu_only_machine_in_one_line(name, capsys):
    assert main([name]) == 2
    err = capsys.readouterr().err.strip()
    assert "device=cuda but no CUDA GPU is visible" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "name,extra,shows",
    [
        ("engine", ["bench.decode_tokens=2", "bench.repeats=1"], r"\| 300 \| \d+ \| [\d.]+ \|"),
        (
            "decode_methods",
            ["bench.decode_tokens=2", "bench.repeats=1", "bench.kivi_group=16"],
            r"\| 300 \| kivi-4, packed attention \| [\d.]+ \| ×",
        ),
        (
            "h2o_prefill",
            ["bench.repeats=1"],
            r"\| all \(Σ\) \| [\d.]+ s ×1.00 \| [\d.]+ s ×[\d.]+ \| [\d.]+ s ×[\d.]+ \|",
        ),
        ("gpu", ["bench.decode_tokens=2", "grid.method=[full,snapkv]"], r"tiny-random +300 +snapkv +0.250"),
        ("vs_generate", ["bench.new_tokens=3", "bench.repeats=1"], r"tokens identical: True \(3 vs 3 tokens\)"),
    ],
)
def test_random_prompt_benchmarks_run_on_the_tiny_model(name, extra, shows, capsys):
    out = run([name, *SHORT, *extra], capsys)
    assert f"{name} benchmark: tiny-random float32 on cpu" in out and re.search(shows, out), out


def test_engine_measures_each_dtype_and_their_ratio(capsys):
    out = run(
        [
            "engine",
            "model=tiny-random",
            "device=cpu",
            "task.context_lengths=[300]",
            "bench.decode_tokens=2",
            "bench.repeats=1",
            "bench.dtypes=[bfloat16,float32]",
        ],
        capsys,
    )
    assert "| context | prefill tok/s bfloat16 | prefill tok/s float32 |" in out
    assert re.search(r"300: bf16 prefill [\d.]+× fp32 throughput; bf16 decode [\d.]+× faster", out)


def test_cpu_kernels_switches_each_kernel_off(capsys):
    from kvbench.kernels.backend import backend

    if backend("cpu") is None:
        pytest.skip("the CPU kernels are off or not built here")
    out = run(["cpu_kernels", *SHORT, "bench.repeats=1", "bench.decode_tokens=2", "bench.workloads=[full]"], capsys)
    for path in ("on", "off", "−decode_linear", "−decode_attention"):
        assert re.search(rf"\| float32 \| 300 \| full \| {path} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| ×[\d.]+ \|", out)


@pytest.mark.parametrize("task", ["niah", "ppl"])
def test_peak_memory_per_method_and_mode(task, tmp_path, capsys):
    modes = "[shared,inline]" if task == "ppl" else "[shared,inline,chunked]"
    out = run(
        [
            "peak_memory",
            *TINY,
            f"task={task}",
            "bench.context=300",
            "bench.chunk=64",
            "bench.new_tokens=2",
            "grid.method=[full,snapkv]",
            f"bench.modes={modes}",
            "bench.cap_mib=1000",
            f"bench.csv={tmp_path / 'peak.csv'}",
        ],
        capsys,
    )
    assert re.search(r"\| snapkv \| \d+ \| \d+ \|", out) and "fits_cap=True" in out
    assert (tmp_path / "peak.csv").read_text().startswith("method,budget,mode,peak_MiB")


def test_shared_prefill_outputs_agree_and_a_baseline_is_compared(tmp_path, capsys):
    grid = ["grid.method=[snapkv,h2o]", "grid.budget=[0.5]"]
    base = tmp_path / "base.json"
    out = run(["shared_prefill", *NIAH, *grid, f"bench.save_baseline={base}"], capsys)
    assert "(2 outputs) ->" in out and json.loads(base.read_text())["configurations"] == ["snapkv:0.5", "h2o:0.5"]
    out = run(["shared_prefill", *NIAH, *grid, f"bench.baseline={base}"], capsys)
    assert "identical outputs, grid vs one by one: 2/2; one by one vs separate: 2/2" in out
    assert re.search(r"vs \S* ?\(shared prefill, one by one\): .* identical outputs 2/2", out)
    assert main(["shared_prefill", *NIAH, "grid.method=[snapkv]", f"bench.baseline={base}"]) == 2
    assert "was timed with other settings: configurations" in capsys.readouterr().err


def test_throughput_writes_its_rows_and_the_reports_long_table(tmp_path, capsys):
    out_csv = tmp_path / "throughput" / "throughput.csv"
    out = run(
        [
            "throughput",
            *TINY,
            "grid.method=[snapkv]",
            "bench.context=300",
            "bench.new_tokens=2",
            "bench.max_batch=4",
            "bench.max_tries=2",
            "bench.memory_limit_gb=8",
            f"bench.out={out_csv}",
        ],
        capsys,
    )
    assert re.search(r"snapkv:0.25 +\d+ ", out) and "kv_bytes_exact" in out
    names = {p.name for p in out_csv.parent.iterdir()}
    assert names == {"throughput.csv", "throughput_summary.csv", "predicted_vs_measured.csv"}


def test_kvzip_and_its_grid(capsys):
    out = run(["kvzip", *NIAH, "bench.repeats=1", "bench.grid=[0.5,0.25]"], capsys)
    assert re.search(r"\| \d+ \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \| [\d.]+ \| ", out)
    assert "kvzip grid of 2 budgets on one prefill" in out


def test_h2o_mass_analyses_where_the_mass_goes(tmp_path, capsys):
    out = run(["h2o_mass", *NIAH, f"bench.json={tmp_path / 'h2o.json'}"], capsys)
    assert re.search(r"needle +[\d.]+ +[\d.]+", out) and "Jaccard overlap of kept positions" in out
    assert set(json.loads((tmp_path / "h2o.json").read_text())[0]["needle_kept"]) == {
        "h2o (sum)",
        "h2o (mean)",
        "snapkv",
        "original",
    }


def test_prefix_with_and_without_the_cache(capsys):
    out = run(
        [
            "prefix",
            *TINY,
            "bench.context=300",
            "bench.chat_context=400",
            "bench.questions=2",
            "bench.turns=2",
            "bench.max_new_tokens=3",
            "bench.qa_max_new_tokens=3",
        ],
        capsys,
    )
    assert re.search(r"multiturn +2 .* True", out)


def test_fidelity_reuse_on_the_cpu(capsys):
    assert main(["fidelity_reuse", "device=cpu", "dtype=float32"]) in (0, 1)  # CPU peaks are the process's RSS
    out = capsys.readouterr().out
    assert len(re.findall(r"^float32 \w+ .* tokens same True", out, re.M)) == 5


def test_diagnose_evidence_reads_a_diagnosed_run(tmp_path, capsys):
    from kvbench.bench.common import compose
    from kvbench.run.runner import run as run_kvbench

    overrides = [*NIAH, "task.depths=[0.1]", "grid.method=[snapkv]", "grid.budget=[0.1]", "diagnose=true"]
    run_kvbench(compose(overrides, f"results_dir={tmp_path / 'store'}"), output_dir=tmp_path / "out")
    capsys.readouterr()
    out = run(["diagnose_evidence", f"bench.results={tmp_path / 'store'}", "bench.method=snapkv"], capsys)
    assert re.search(r"snapkv @0.1 .* verdict: ", out) and "all evidence kept in every head: layers" in out


def test_leaderboard_vs_kvpress_on_the_committed_boards(capsys):
    out = run(["leaderboard_vs_kvpress"], capsys)
    assert re.search(r"\| smollm2-135m \| meta-llama/Llama-3.1-8B-Instruct \| 0.5 \| \d+ \|", out)


@pytest.mark.parametrize("name", ["engine_parity", "engine_options"])
def test_engine_benchmarks_refuse_without_the_engines_venv(name, capsys):
    from kvbench.engines import ENGINES

    engine = "openvino"
    if ENGINES.get(engine).installed():
        pytest.skip(f"{engine}'s venv is built here: the parity run itself would start the engine")
    assert main([name, f"engine={engine}", "model=smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"make engine-{engine}" in err and len(err.splitlines()) == 1


@pytest.mark.real_model
def test_lm_eval_vs_hf_on_the_bundled_model(capsys):
    out = run(["lm_eval_vs_hf", "limit=1", "bench.tasks=[kvbench_mc]"], capsys)
    assert re.search(r"kvbench_mc: acc,none hf [\d.]+ kvbench [\d.]+", out) and "responses identical" in out


def test_lm_eval_vs_hf_needs_a_transformers_folder(capsys):
    assert main(["lm_eval_vs_hf", *TINY]) == 2
    assert "has no transformers folder" in capsys.readouterr().err
