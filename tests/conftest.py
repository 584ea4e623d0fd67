"""Shared fixtures: the tiny random Llama (fp32, CPU) and Hydra config composition."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.model.load import load_model
from kvbench.native.engine import Engine

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def tiny_overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "report=false",
        "task.context_lengths=[700,1000]",
        "task.depths=[0.2,0.8]",
        "task.max_new_tokens=6",
        *extra,
    ]


@pytest.fixture(scope="session")
def tiny():
    return load_model(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml"), "cpu", "float32")


def skip_without_venvs(*venvs: str, make: str) -> None:
    """An engine runs in its own venv; .ci/run builds them before `make test`, a fresh `make test` does not: skip in
    one line naming the make target."""
    from kvbench.engines.source import venv_python

    missing = [v for v in venvs if not venv_python(v).exists()]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: make {make}")


def skip_without_serving_engines(*venvs: str) -> None:
    """Serving beside vLLM / OpenVINO needs their venvs."""
    skip_without_venvs(*venvs, make="engine-vllm engine-openvino")


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    return Engine(tiny)


@pytest.fixture(scope="session")
def prompt_ids(tiny):
    return tiny.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]  # 540 tokens


def eager_attentions(lm, ids: list[int]) -> tuple:
    """Every layer's attention weights (B, H_q, T, T) from transformers' eager attention: the reference."""
    import torch

    from kvbench.model.attention import register

    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return lm.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    finally:
        lm.model.set_attn_implementation(register())


def run_interpreted(child_code: str, inputs, tmp: Path):
    """Run `child_code` (reads argv[1], writes argv[2] with torch.save) under TRITON_INTERPRET=1 in a child
    process: Triton picks interpreter or compiler when its functions are defined, so it cannot be switched
    inside this already-initialised test process."""
    import os
    import subprocess
    import sys

    import torch

    torch.save(inputs, tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", child_code, tmp / "in.pt", tmp / "out.pt"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "out.pt")


def ppl_window_rows():
    """Stored rows of one streamed-perplexity text in two windows, for two configurations (snapkv 0.25, prefill
    shared vs inline): what the report's peak-memory table reads."""
    import pandas as pd

    mib = 2**20
    return pd.DataFrame(
        {
            "run_id": "r",
            "model": "m",
            "task": "ppl",
            "config_hash": ["a", "a", "b", "b"],
            "example_id": ["ppl-prose-L2048-s0/w000", "ppl-prose-L2048-s0/w001"] * 2,
            "window": [0, 1, 0, 1],
            "context_tokens": [1024, 2048, 1024, 2048],
            "method": "snapkv",
            "budget": 0.25,
            "prefill": ["shared", "shared", "inline", "inline"],
            "prefill_chunk": None,
            "peak_mem_delta_bytes": [300 * mib, 310 * mib, 250 * mib, 240 * mib],
            "peak_mem_bytes": [900 * mib, 950 * mib, 850 * mib, 860 * mib],
        }
    )


def native_method_names() -> list[str]:
    """Every registered method but the kvpress adapter: it is registered only where kvpress imports (its own venv,
    transformers 5.2), compresses inside its own prefill, and its invariants are tests/kvpress/'s."""
    from kvbench.methods import METHODS

    return [name for name in METHODS.names() if name != "kvpress"]


def compressed(method, kv, stats, budget):
    """(the example's compression, the cache it built) of a whole prefill's `kv`: what Engine.compressed does."""
    compression = method.begin(kv[0][0].shape[2], len(kv), budget)
    return compression, compression.run(kv, stats)
