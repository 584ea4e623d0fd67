"""Shared fixtures: the tiny random Llama (fp32, CPU) and Hydra config composition."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.engine import Engine
from kvbench.models import load_model

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def tiny_overrides(tmp_path: Path, *extra: str) -> list[str]:
    return ["model=tiny-random", "device=cpu", "dtype=float32", f"results_dir={tmp_path / 'store'}", "report=false",
            "task.context_lengths=[700,1000]", "task.depths=[0.2,0.8]", "task.max_new_tokens=6", *extra]


@pytest.fixture(scope="session")
def tiny():
    return load_model(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml"), "cpu", "float32")


@pytest.fixture(scope="session")
def tiny_engine(tiny):
    return Engine(tiny)


@pytest.fixture(scope="session")
def prompt_ids(tiny):
    return tiny.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]  # 540 tokens
