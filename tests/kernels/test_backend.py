"""The CPU backend is optional (kvbench.kernels.backend): with kvbench/kernels/cpu absent — its import made to fail, the
model loaded afresh — the tiny model runs end to end (a grid of eviction methods decoded together, and KIVI) with the
rows of KVBENCH_NO_CPU_EXT=1, and with the same tokens as with the C kernels."""

import inspect
import sys

import pandas as pd
import pytest

from kvbench.kernels.backend import CpuKernels, backend
from kvbench.model import load
from kvbench.run.runner import run
from tests.conftest import compose_config, tiny_overrides

EXAMPLES = ("task.depths=[0.5]",)  # × 2 context lengths
RUNS = [
    ("grid.method=[full,snapkv,h2o]", "grid.budget=[0.5]", *EXAMPLES),  # h2o: per-step eviction, in place with C
    ("method=kivi", "method.group_size=16", "method.residual_length=32", *EXAMPLES),
]
SAME = ["config_hash", "example_id", "method", "budget", "context_tokens", "new_tokens", "prediction", "score",
        "kv_bytes", "kv_bytes_full"]  # fmt: skip  # every column but timings, memory peaks and provenance


def rows(tmp_path, monkeypatch, label: str, env: str | None = None, absent: bool = False) -> pd.DataFrame:
    with monkeypatch.context() as m:
        m.setattr(load, "_LOADED", {})  # the session's tiny model has the kernel's linear layers: load it afresh
        if absent:
            m.setitem(sys.modules, "kvbench.kernels.cpu", None)  # `import kvbench.kernels.cpu` fails: no folder
            assert backend("cpu") is None
        if env is not None:
            m.setenv("KVBENCH_NO_CPU_EXT", env)
        out = [run(compose_config(*tiny_overrides(tmp_path / label, *o)), output_dir=tmp_path / label) for o in RUNS]
    table = pd.concat(out).drop_duplicates(["config_hash", "example_id"])  # each run has the full cache's rows
    table = table.sort_values(["method", "budget", "example_id"], na_position="first")
    return table[SAME].reset_index(drop=True)


def test_without_the_folder_rows_are_those_of_the_switch_and_tokens_those_of_the_kernels(tmp_path, monkeypatch):
    absent = rows(tmp_path, monkeypatch, "absent", absent=True)
    assert len(absent) == 2 * 4 and set(absent.method) == {"full", "snapkv", "h2o", "kivi"}
    pd.testing.assert_frame_equal(absent, rows(tmp_path, monkeypatch, "switched_off", env="1"))
    if backend("cpu") is None:
        pytest.skip("KVBENCH_NO_CPU_EXT=1 or no kvbench/kernels/cpu here: nothing to compare with")
    with_kernels = rows(tmp_path, monkeypatch, "kernels", env="0")
    assert with_kernels.prediction.tolist() == absent.prediction.tolist()  # fp32: the same greedy tokens
    assert with_kernels.kv_bytes.tolist() == absent.kv_bytes.tolist()
    assert set(with_kernels.config_hash).isdisjoint(absent.config_hash)  # the kernels ran: their rows hash apart


def test_the_cpu_backend_offers_every_operation_of_the_interface():
    cpu = pytest.importorskip("kvbench.kernels.cpu")
    operations = {name: f for name, f in vars(CpuKernels).items() if inspect.isfunction(f) and name[0] != "_"}
    assert len(operations) == 8
    for name, operation in operations.items():
        want = list(inspect.signature(operation).parameters)[1:]  # without self
        assert list(inspect.signature(getattr(cpu, name)).parameters) == want, name
