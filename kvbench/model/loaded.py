"""A loaded model (`LoadedModel`: the model, its tokenizer, device and dtype, its cache layout) and the registry
every loader registers into (`LOADERS`, by the `loader` key of conf/model/*.yaml). The loaders live in their own
files (random_models.py, checkpoint.py, gguf_models.py); kvbench.model.load picks one and caches the result."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

from kvbench.config.registry import Registry
from kvbench.model import attention, layout
from kvbench.model.cache import model_cache, split_model_cache
from kvbench.model.layout import CacheLayout, cache_layout

LOADERS = Registry("model loader")


def cache_kwarg(model) -> str:
    """`model.forward`'s name for the cache: `cache` (transformers 5.24) or `past_key_values` (5.2, kvpress's pin)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self):
        return self.model.config

    @functools.cached_property
    def cache_kwarg(self) -> str:
        """The forward's name for the cache argument; read once, not per step."""
        return cache_kwarg(self.model)

    def forward(self, ids: list[int], positions: list[int], cache, all_logits: bool = False, fp32: bool = True):
        """Run `ids` at RoPE `positions` through the model, appending to `cache`.

        Returns fp32 logits (1, V) for the last position, or (len(ids), V) with all_logits (perplexity); fp32=False:
        in the model's dtype (a long chunk's fp32 copy would be a streamed window's largest tensor:
        kvbench.native.streaming upcasts block by block)."""
        own = model_cache(cache, self.config)  # a hybrid's view laid out as the model's own cache (else `cache`)
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),  # (1, R)
            position_ids=torch.tensor([positions], device=self.device),  # (1, R)
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **{self.cache_kwarg: own},
        )
        if own is not cache:
            split_model_cache(cache, self.layout)  # the prompt's forward filled transformers' layers: the view's now
        return out.logits[0].float() if fp32 else out.logits[0]  # (1 or R, V)

    @functools.cached_property
    def layout(self) -> CacheLayout:
        """Each layer's cache kind and width (kvbench.model.layout): what the model's own cache holds. Read once
        (the engine asks per configuration); a converted copy (`dataclasses.replace`) reads its own."""
        return cache_layout(self.config, self.dtype)

    @property
    def n_layers(self) -> int:
        """Cache layers a method compresses: every decoder layer, or a hybrid's attention layers alone."""
        return len(self.layout.layers)

    @property
    def n_kv_heads(self) -> int:
        return layout.n_kv_heads(self.config)

    @property
    def n_q_heads(self) -> int:
        return layout.n_q_heads(self.config)

    @property
    def head_dim(self) -> int:
        return layout.head_dim(self.config)

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings


def finish(model, tokenizer, name, device, dtype) -> LoadedModel:
    """The model in eval mode on `device` in `dtype`, its attention through kvbench's (statistics, kernels)."""
    model.to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(attention.register())
    model.requires_grad_(False)
    lm = LoadedModel(name=name, model=model, tokenizer=tokenizer, device=device, dtype=dtype)
    position = {decoder: i for i, decoder in enumerate(lm.layout.decoder_index or ())}
    for module in model.modules():  # a hybrid's attention modules record statistics under their cache layer
        if position and getattr(module, "layer_idx", None) in position:
            module.kvbench_cache_index = position[module.layer_idx]
    return lm
