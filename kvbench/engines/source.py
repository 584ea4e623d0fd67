"""What the vLLM and OpenVINO engines share on kvbench's side: the model folder they load (kvbench's own converted
HF folder, so every engine reads the same weights), the cache shape read from its config, the engine venvs, and
the budget in tokens."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvbench import KvbenchError

REPO = Path(__file__).resolve().parents[2]  # the checkout: .venv-<engine> lie beside pyproject.toml


def venv_python(venv: str) -> Path:
    return REPO / venv / "bin" / "python"


def hf_model_dir(model_cfg: dict) -> Path:
    """The HF folder an engine loads: model=hub's own path, or kvbench's conversion of a bundled GGUF (made once
    here by loading the model as kvbench does, ~20 s the first time)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(dict(model_cfg))
    if cfg.get("loader") == "pretrained":
        path = Path(str(cfg.get("name_or_path") or ""))
        if not (path / "config.json").is_file():
            raise KvbenchError(
                f"serving engines need model.name_or_path as a local directory; {path} has no config.json"
            )
        return path
    from kvbench.model.load import MARKER, converted_dir, load_model

    target = converted_dir(cfg.name)
    if not (target / MARKER).is_file():
        load_model(cfg, "cpu", "float32")  # converts once into target and verifies it
    return target


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    sliding_layers: int = 0
    window: int = 0

    @classmethod
    def read(cls, model_dir: Path) -> CacheShape:
        config = json.loads((model_dir / "config.json").read_text())
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        types = config.get("layer_types") or []
        sliding = sum(t == "sliding_attention" for t in types)
        return cls(
            config["num_hidden_layers"],
            config.get("num_key_value_heads", heads),
            head_dim,
            sliding,
            int(config.get("sliding_window") or 0) if sliding else 0,
        )

    def elements_per_token(self, layers: int | None = None) -> int:
        """K and V elements one token adds to `layers` layers (all by default)."""
        return 2 * (self.layers if layers is None else layers) * self.kv_heads * self.head_dim


def budget_tokens(budget: float | None, prompt_tokens: int) -> int:
    """kvbench's budget as tokens of the prompt: a fraction ≤ 1 of it, or a token count > 1."""
    if budget is None:
        return prompt_tokens
    return math.ceil(budget * prompt_tokens) if budget <= 1 else int(budget)
