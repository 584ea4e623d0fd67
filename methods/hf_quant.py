"""transformers' own quantized KV cache (`QuantizedCache`, quanto / HQQ / fp8 backends) as a reference method.

Not KIVI: its group-wise backends quantize keys and values both along the same axis with one group size and a
full-precision residual that is re-quantized wholesale when it fills; fp8 is per-tensor with a frozen scale.
quanto and HQQ are optional installs (`pip install 'kvbench[quanto]'` / `'kvbench[hqq]'`); fp8 needs nothing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, Method
from kvbench.methods.compression import Compression


def fp8_available() -> bool:
    """transformers' QuantizedCache offers "fp8" where it has Fp8QuantizedLayer (not in 5.2, kvpress's pin)."""
    import transformers.cache_utils

    return hasattr(transformers.cache_utils, "Fp8QuantizedLayer")


ENGINES = {"quanto": ("optimum.quanto", "quanto"), "hqq": ("hqq", "hqq"), "fp8": (None, None)}
# what each backend's transformers layer accepts (QuantoQuantizedLayer, HQQQuantizedLayer): refused here, before the
# model loads, not as the layer's ValueError mid-run
NBITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
AXES = {"quanto": (0, -1), "hqq": (0, 1)}


@METHODS.register("hf-quant")
@dataclass
class HFQuantizedCache(Method):
    backend: str = "quanto"  # quanto | hqq | fp8
    nbits: int = 4  # quanto: 2 or 4; hqq: 1, 2, 3, 4 or 8; ignored by fp8
    q_group_size: int = knob(64, min=1)
    residual_length: int = knob(128, tokens=True)
    axis_key: int = knob(0, min=-1)
    axis_value: int = knob(0, min=-1)

    # transformers' quantized layers cannot drop tokens
    caps = Capabilities(
        family="precision", has_budget=False, layers_can_select=False, needs=frozenset({"full_attention_layers"})
    )

    def __post_init__(self):
        if self.backend not in ENGINES:
            raise KvbenchError(f"hf-quant backend={self.backend!r}: use one of {', '.join(ENGINES)}")
        if self.backend in NBITS and self.nbits not in NBITS[self.backend]:
            raise KvbenchError(
                f"hf-quant nbits={self.nbits} with backend={self.backend}: use one of "
                f"{', '.join(map(str, NBITS[self.backend]))}"
            )
        for name in ("axis_key", "axis_value"):
            if self.backend in AXES and getattr(self, name) not in AXES[self.backend]:
                raise KvbenchError(
                    f"hf-quant {name}={getattr(self, name)} with backend={self.backend}: use one of "
                    f"{', '.join(map(str, AXES[self.backend]))}"
                )
        module, extra = ENGINES[self.backend]
        if self.backend == "fp8" and not fp8_available():
            import transformers

            raise KvbenchError(
                f"hf-quant backend=fp8: transformers {transformers.__version__} has no fp8 QuantizedCache (it came "
                "with Fp8QuantizedLayer); use backend=quanto or hqq, or a newer transformers"
            )
        if module and importlib.util.find_spec(module.split(".")[0]) is None:
            raise KvbenchError(
                f"hf-quant backend={self.backend} needs its optional package: "
                f"pip install 'kvbench[{extra}]'"
                + ("   (or use backend=fp8, which needs none)" if fp8_available() else "")
            )
        self.model_config = None  # the bound model's config (`bind`): what QuantizedCache sizes its layers by

    @classmethod
    def lossless_params(cls, lm):
        return None  # every backend is lossy

    def bind(self, lm) -> None:
        self.model_config = lm.config

    def begin(self, n_prompt, n_layers, budget) -> QuantizedCompression:
        return QuantizedCompression(self, n_prompt, n_layers, budget)


class QuantizedCompression(Compression):
    """One example's transformers QuantizedCache: its layers quantize the prompt on their first update."""

    method: HFQuantizedCache

    def __init__(self, method: HFQuantizedCache, n_prompt: int, n_layers: int, budget):
        from transformers import QuantizedCache

        super().__init__(method, n_prompt, n_layers, budget)
        options = (
            {}
            if method.backend == "fp8"
            else dict(
                nbits=method.nbits,
                q_group_size=method.q_group_size,
                residual_length=method.residual_length,
                axis_key=method.axis_key,
                axis_value=method.axis_value,
            )
        )
        try:
            self.cache = QuantizedCache(method.backend, method.model_config, **options)
        except (ValueError, ImportError) as error:
            raise KvbenchError(f"hf-quant: {error}") from None

    def layer(self, layer_idx, keys, values, stats):
        layer = self.cache.layers[layer_idx]
        layer.update(keys, values)  # the first update quantizes the whole prompt
        return layer

    def end(self, layers, stats):
        self.cache.layers = list(layers)
        return self.cache
