"""Models with random weights: a tiny random Llama (`loader: tiny_random`, the tests' model) and real architectures
from their config alone (`loader: random_init`, latency/memory benchmarks), both with a byte-level tokenizer built in
code (no files)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

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


@LOADERS.register("tiny_random")
def load_tiny_random(cfg, device, dtype) -> LoadedModel:
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    config = LlamaConfig(**plain_section(cfg.architecture))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return finish(model, byte_tokenizer(), cfg.name, device, dtype)


@LOADERS.register("random_init")
def load_random_init(cfg, device, dtype) -> LoadedModel:
    """A real architecture with random weights (latency/memory benchmarks: weights do not change the timing)."""
    arch = plain_section(cfg.architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return finish(model, byte_tokenizer(), cfg.name, device, dtype)
