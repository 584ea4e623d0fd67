"""Models with random weights: a tiny random Llama (`loader: tiny_random`, the tests' model) and real architectures
from their config alone (`loader: random_init`, latency/memory benchmarks), both with a byte-level tokenizer built in
code (no files)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from kvbench.model.loaded import LOADERS, LoadedModel, finish

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code (256 byte tokens + ChatML specials): for random models, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def plain_section(node) -> Any:
    """A config section as plain Python containers (transformers' configs reject OmegaConf nodes)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


def architecture_config(cfg):
    """The transformers config of a random model's `architecture` section (`tiny_random`: a Llama; `random_init`: its
    `model_type`). A key the config class does not have is one line naming the closest field: transformers would
    keep it as an unused attribute, and the model its default (a typo such as `num_hiden_layers` planning, measuring
    another model)."""
    import difflib

    from kvbench import KvbenchError

    arch = plain_section(cfg.architecture)
    kind = "llama" if cfg.loader == "tiny_random" else arch.pop("model_type", None)
    try:
        default = AutoConfig.for_model(kind)
    except (ValueError, KeyError, TypeError):
        raise KvbenchError(f"model.architecture.model_type={kind!r} is not a transformers model type") from None
    config = AutoConfig.for_model(kind, **arch)
    fields = set(default.to_dict())
    # a key the class consumed (a legacy name such as rope_theta, folded into rope_parameters) is not kept as is
    stray = [key for key in arch if key in config.to_dict() and key not in fields]
    if stray:
        close = difflib.get_close_matches(stray[0], sorted(fields), n=1)
        hint = f"did you mean {close[0]}?" if close else f"see {type(config).__name__}'s fields"
        raise KvbenchError(f"model.architecture.{stray[0]} is not a {type(config).__name__} field; {hint}")
    return config


@LOADERS.register("tiny_random")
def load_tiny_random(cfg, device, dtype) -> LoadedModel:
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    model = AutoModelForCausalLM.from_config(architecture_config(cfg), dtype=torch.float32)
    return finish(model, byte_tokenizer(), cfg.name, device, dtype)


@LOADERS.register("random_init")
def load_random_init(cfg, device, dtype) -> LoadedModel:
    """A real architecture with random weights (latency/memory benchmarks: weights do not change the timing)."""
    config = architecture_config(cfg)
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return finish(model, byte_tokenizer(), cfg.name, device, dtype)
