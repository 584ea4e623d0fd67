"""Hub ids and local checkpoint folders (`loader: pretrained`, model=hub): a local folder is checked before its
weights load (one line per problem), and a load that leaves weights random or of the wrong shape is refused
(`from_pretrained_complete`, which kvbench's own GGUF conversions are loaded through too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvbench import KvbenchError
from kvbench.model import layout
from kvbench.model.loaded import LOADERS, LoadedModel, finish

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
    return finish(model, tokenizer, cfg.name if cfg.name != "hub" else str(path), device, dtype)
