"""A serving engine is one module behind `ServingEngine` and nothing else: a fake engine (the ServingEngine subclass
below, its worker tests/engines/fake_engine_worker.py, a process speaking the worker protocol with the standard
library only) registered by this test alone goes through a run (`python -m kvbench engine=fake ...`: the runner), a
serving trace (`python -m kvbench.serving serving.engines=[fake:full,fake:half]`) and the report over what both wrote,
on the tiny model. No file of kvbench names it: the run, the serving trace and the report ask the registry."""

from __future__ import annotations

import json
import math
import sys

import pytest

from kvbench import KvbenchError
from kvbench.engines import ENGINES
from kvbench.engines.base import EngineGeneration, EngineRequest, ServingEngine
from kvbench.engines.protocol import Worker
from kvbench.engines.source import budget_tokens
from kvbench.plan.hardware import Hardware
from tests.conftest import compose_config, tiny_overrides
from tests.engines.fake_engine_worker import VERSION

HW = Hardware("test", 10**12, 1e11, 1e12, "test")  # the planner's hardware: no CPU calibration in tests
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class FakeEngine(ServingEngine):
    """engine=fake: `full` at the model's dtype, `half` at half its bytes per element, `recent` keeping the budget's
    share of the prompt (its own eviction option, so it takes kvbench's budget)."""

    name = "fake"
    venv = ".venv-fake"
    make_target = "engine-fake"
    options = {"full": {"element": 1.0}, "half": {"element": 0.5}, "recent": {"element": 1.0, "evict": "recent"}}
    serving_options = ("full", "half")
    block_tokens = 4
    tells_queue = True

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.elements, self.dtype_bytes = 0, 4

    @classmethod
    def evicts(cls, option: str) -> bool:
        return "evict" in cls.options.get(option, {})

    @classmethod
    def installed(cls) -> bool:
        return True  # its worker runs on kvbench's own python: no venv to build

    def unavailable(self, model_cfg: dict, option: str) -> str | None:
        if option not in self.options:
            return f"engine=fake has no option {option!r}; use one of {', '.join(self.options)}"
        if "architecture" not in model_cfg:
            return "engine=fake runs model=tiny-random only (its shape is written in its yaml)"
        return None

    def start(self, model_cfg: dict, dtype: str) -> None:
        arch = model_cfg["architecture"]
        self.elements = 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * arch["head_dim"]
        self.dtype_bytes = DTYPE_BYTES[dtype]
        self.worker = Worker(sys.executable, "tests.engines.fake_engine_worker", "the fake worker")
        self.info = self.worker.request("start", elements_per_token=self.elements)

    def element(self, option: str) -> int:
        return int(self.dtype_bytes * self.options[option]["element"])

    def generate(self, request: EngineRequest) -> EngineGeneration:
        assert self.worker is not None
        evicts = self.evicts(request.option)
        reply = self.worker.request(
            "generate",
            prompt_ids=list(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
            stop_ids=list(request.stop_ids),
            element_bytes=self.element(request.option),
            full_bytes=self.dtype_bytes,
            keep=budget_tokens(request.budget, len(request.prompt_ids)) if evicts else None,
        )
        reply["extra"] = {"knobs": self.options[request.option], **reply["extra"]}
        return EngineGeneration(**reply)

    def serve(self, option, budget, kv_budget, requests, stop_ids) -> tuple[dict, int]:
        assert self.worker is not None
        block = self.block_tokens * self.elements * self.element(option)
        reply = self.worker.request(
            "serve_trace", requests=requests, stop_ids=stop_ids, kv_blocks=kv_budget // block, block_tokens=4
        )
        return {**reply, "engine_version": self.version}, block

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None


@pytest.fixture(scope="module")
def registered():
    """engine=fake in the registry for this module's tests only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(ENGINES._entries, "fake", FakeEngine)
        yield


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fake-engine")


@pytest.fixture(scope="module")
def ran(registered, workdir):
    """`python -m kvbench engine=fake 'grid.method=[half,recent]' grid.budget=[0.5]` on the tiny model."""
    from kvbench.run.runner import run

    cfg = compose_config(*tiny_overrides(workdir, "engine.name=fake", "grid.method=[half,recent]", "grid.budget=[0.5]"))
    return run(cfg, output_dir=workdir / "out")


@pytest.fixture(scope="module")
def served(registered, workdir):
    """`python -m kvbench.serving` with the fake engine beside kvbench's full cache: four requests at once in a KV
    budget whose full-precision blocks hold three of them, half-precision blocks all four."""
    from kvbench.serving.run import serve
    from tests.serving.test_inputs import serving_config

    overrides = ["method=full", "grid.method=null", "grid.budget=null", "serving.requests=4", "serving.arrival=burst"]
    cfg = serving_config(*overrides, "serving.engines=[fake:full,fake:half]")
    return serve(cfg, workdir / "serving", hardware=HW, echo=False)


def test_a_run_writes_the_engines_rows(ran):
    rows = ran.set_index(["example_id", "method"], drop=False)
    assert sorted(set(rows["method"])) == ["full", "half", "recent"] and len(rows) == 4 * 3
    assert set(rows["engine"]) == {"fake"} and set(rows["engine_version"]) == {VERSION}
    assert (rows["engine_invalid"] == "").all()
    for example in set(rows["example_id"]):
        full, half, recent = (rows.loc[(example, m)] for m in ("full", "half", "recent"))
        ids = json.loads(full["engine_extra"])["token_ids"]
        assert ids == json.loads(half["engine_extra"])["token_ids"] and 1 <= len(ids) <= 6  # deterministic
        assert full["kv_ratio"] == 1.0 and half["kv_ratio"] == 0.5
        steps = len(ids) - 1
        assert recent["kv_bytes"] == (math.ceil(0.5 * recent["context_tokens"]) + steps) * 256 * 4  # 256 K/V a token
        assert full["prefill_s"] == pytest.approx(1e-5 * full["context_tokens"])
        parity = json.loads(full["engine_extra"])["parity"]  # kvbench's own full cache on the same ids
        assert parity["compared"] > 0 and isinstance(parity["identical"], bool)
        assert json.loads(half["engine_extra"])["knobs"] == {"element": 0.5}


def test_its_refusals_come_before_the_model_loads(registered, tmp_path):
    from kvbench.__main__ import engine_option_as_method
    from kvbench.preflight.entrance import check_run

    with pytest.raises(KvbenchError, match="engine=fake runs model=tiny-random only"):
        check_run(compose_config("engine.name=fake", "model=smollm2-135m", "grid.method=[half]"))
    with pytest.raises(KvbenchError, match="engine=fake has no option 'q8_0'; valid: full, half, recent"):
        check_run(compose_config(*tiny_overrides(tmp_path, "engine.name=fake", "grid.method=[q8_0]")))
    said = engine_option_as_method(["engine=fake", "method=half"])
    assert said == "method=half is engine=fake's option, not a kvbench method: give it as 'grid.method=[half]'"


def test_a_serving_trace_through_the_engine(served):
    requests, runs = served
    assert sorted(runs["method"]) == ["fake:full", "fake:half", "full"]
    assert not runs.attrs["skipped"]
    fake = runs[runs["engine"] == "fake"].set_index("method")
    assert set(fake["engine_version"]) == {VERSION}
    assert (fake["peak_kv_bytes"] <= fake["kv_budget_bytes"]).all()
    # half-precision blocks are half the bytes: the same budget holds all four requests, full-precision ones three
    assert fake.loc["fake:full", "max_concurrency"] == 3 and fake.loc["fake:half", "max_concurrency"] == 4
    theirs = requests[requests["engine"] == "fake"]
    assert len(theirs) == 2 * 4 and theirs["score"].notna().all() and (theirs["output_tokens"] > 0).all()
    assert (theirs["ttft_s"] >= theirs["queue_s"]).all() and theirs["queue_s"].max() > 0  # the fourth waited


def test_the_report_shows_the_engine(ran, served, workdir):
    from kvbench.report.build import main as report_main

    out = workdir / "report"
    assert report_main([str(workdir / "store"), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    lines = md.splitlines()
    assert any(line.startswith(f"| fake | {VERSION} | tiny-random | float32 | niah | 4 |") for line in lines)  # parity
    offers = {line.split("|")[3].strip(): line for line in lines if line.startswith("| fake | tiny-random |")}
    assert set(offers) == {"full", "half", "recent 0.5"} and offers["half"].rstrip(" |").endswith("yes")
    assert "fake: the model's dtype" in md  # what its kv_ratio is against, from its ServingEngine
    assert list(out.glob("engines_tiny-random_niah*.png"))  # its own marker on the plot of every engine
    assert "fake:half" in md  # the serving trace's runs, found beside the store
