"""Each decode row's share of the bandwidth bound (kvbench.native.bandwidth): the probe is cached per machine, a
setting overrides it, a damaged cache is one line; a step's bytes are the weights + the K/V it reads, and every
decoding row of a run carries them."""

import json
import math

import pytest
import torch

from kvbench import KvbenchError
from kvbench.native import bandwidth
from kvbench.run.runner import run
from tests.conftest import compose_config, tiny_overrides


def test_the_probe_runs_once_per_machine_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.delenv("KVBENCH_BANDWIDTH_GBS", raising=False)
    monkeypatch.setitem(bandwidth.PROBE_BYTES, "cpu", 16 << 20)
    calls = []
    real = bandwidth.measure
    monkeypatch.setattr(bandwidth, "measure", lambda device: calls.append(device) or real(device))
    first = bandwidth.memory_bandwidth(torch.device("cpu"))
    again = bandwidth.memory_bandwidth(torch.device("cpu"))
    assert first == again > 1e8 and len(calls) == 1  # a CPU reads far more than 100 MB/s
    cached = json.loads((tmp_path / "bandwidth.json").read_text())
    assert list(cached) == [bandwidth.machine_key(torch.device("cpu"))] and "threads" in next(iter(cached))


def test_a_setting_replaces_the_probe_and_bad_values_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("KVBENCH_BANDWIDTH_GBS", "4800")
    assert bandwidth.memory_bandwidth(torch.device("cpu")) == 4.8e12 and not (tmp_path / "bandwidth.json").exists()
    for bad in ("fast", "0", "-3", "inf"):
        monkeypatch.setenv("KVBENCH_BANDWIDTH_GBS", bad)
        with pytest.raises(KvbenchError, match=r"KVBENCH_BANDWIDTH_GBS=.*positive number of GB/s"):
            bandwidth.memory_bandwidth(torch.device("cpu"))
    monkeypatch.delenv("KVBENCH_BANDWIDTH_GBS")
    (tmp_path / "bandwidth.json").write_text('{"x": {"bytes_s": -1}}')
    with pytest.raises(KvbenchError, match=r"bandwidth cache .* is damaged .*rm "):
        bandwidth.memory_bandwidth(torch.device("cpu"))


def test_a_steps_bytes_and_share(tiny):
    """The weights once (tied embeddings once, an untied input table left out) + the K/V; the share is bytes over
    step time over bandwidth; no decode step, no share."""
    weights = bandwidth.weight_bytes(tiny.model)
    every = sum(p.numel() * p.element_size() for p in tiny.model.parameters())
    embed = tiny.model.get_input_embeddings().weight
    tied = embed.data_ptr() == tiny.model.get_output_embeddings().weight.data_ptr()
    assert weights == every - (0 if tied else embed.numel() * embed.element_size())
    got = bandwidth.share_columns(1000, 200, 0.5, 4800.0)
    assert got == {"step_bytes": 1200, "bandwidth_share": pytest.approx(1200 / 0.5 / 4800)}
    assert math.isnan(bandwidth.share_columns(1000, 200, math.nan, 4800.0)["bandwidth_share"])


def test_every_decoding_row_states_its_share(tmp_path, monkeypatch):
    """A grid run: each row's step_bytes is the weights + its batch's K/V (a row alone: its own); its share is
    those bytes over its step time over the run's memory_bandwidth."""
    monkeypatch.setenv("KVBENCH_BANDWIDTH_GBS", "10")
    grid = ["grid.method=[snapkv,h2o]", "grid.budget=[0.3]", "task.max_new_tokens=5", "limit=1"]
    rows = run(compose_config(*tiny_overrides(tmp_path, *grid)), output_dir=tmp_path / "out")
    assert (rows.memory_bandwidth == 1e10).all() and rows.bandwidth_share.notna().all()
    step_s = rows.decode_s / rows.new_tokens.sub(1)
    assert rows.bandwidth_share.tolist() == pytest.approx((rows.step_bytes / step_s / 1e10).tolist(), rel=1e-6)
    alone, batched = rows[rows.batch_size == 1], rows[rows.batch_size > 1]
    assert len(batched) >= 2 and alone.step_bytes.sub(alone.kv_bytes).nunique() <= 1
    weights = int(alone.step_bytes.sub(alone.kv_bytes).iloc[0]) if len(alone) else None
    for _, batch in batched.groupby("example_id"):  # one grid batch per example: the weights + every row's K/V
        assert batch.step_bytes.nunique() == 1 and batch.step_bytes.iloc[0] > batch.kv_bytes.sum()
        if weights is not None:
            assert batch.step_bytes.iloc[0] == weights + batch.kv_bytes.sum()
