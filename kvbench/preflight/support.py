"""Which methods run on which model families, decided from the model's config before the model loads.

A (method, model) pair kvbench cannot measure right is refused with one line naming what is unsupported, never a
traceback mid-run and never a silent wrong number. The rules follow what each method reads of the model:
- latent attention (DeepSeek-V2/V3, `kv_lora_rank`): the cache holds a latent shared by every head, not per-head
  K/V; only methods that select token positions for all heads alike run on it (full, random, streamingllm);
- attention statistics (observation-window votes, column sums): recorded inside transformers' AttentionInterface,
  which some families' attention bypasses (Falcon);
- RoPE frequencies (expected_attention's query moments): a rotary embedding rotating the whole head, one for the
  model or one per layer type (Gemma 3: each layer's own); not GPT-2 (absolute positions), partial rotary (GPT-NeoX)
  or latent attention;
- separate q/k/v projections under `model.model.layers` (headmerge, kvzip): not fused ones (Phi-3's qkv_proj,
  GPT-NeoX's and Falcon's query_key_value, GPT-2's c_attn) nor half-width rotary (gpt-oss, for kvzip);
- kvzip re-derives queries with per-head q norms (not OLMo 2's full-width ones);
- transformers' QuantizedCache (hf-quant) holds only full-attention layers; KIVI attends inside kvbench's attention
  function (not Falcon's own attention), and its groups must divide head_dim.
- hybrid models (linear-attention, Mamba or convolution layers beside attention: Qwen3.5, Nemotron-H, Jamba, ...):
  every method that compresses the attention layers' K/V runs on them; not those that need every decoder layer to
  be attention (headmerge, kvzip's re-run of the prompt, kvpress's hooks, transformers' QuantizedCache), nor, where
  one cache layer holds attention and a Mamba state (Falcon-H1, Zamba2), those holding K/V in layers of their own;
- models kvbench does not compress at all: a cache of their own (MiniMax), DSA indexer keys (DeepSeek-V3.2), and
  layers reusing another's K/V (Gemma 3n, Gemma 4: their full cache runs);
- kvpress's presses (method=kvpress) hook model.model.layers[i].self_attn and would compress a sliding layer's
  window as if it were the prompt: full-attention models with that layout only.
tests/model/test_architectures.py runs every registered method on every family: a pair runs and holds its
invariants, or it is refused here.
"""

from __future__ import annotations

import torch
import transformers
from transformers import cache_utils

from kvbench.model import layout
from kvbench.model.attention import NO_ATTENTION_INTERFACE
from kvbench.model.states import HYBRID_TYPES, STATE_TYPES

HYBRID_CACHE = hasattr(cache_utils, "LinearAttentionLayer")  # transformers keeps a hybrid's states in DynamicCache

POSITION_ONLY = ("full", "random", "streamingllm")  # select token positions, the same for every head
FUSED_QKV = {"phi3": "qkv_proj", "gpt_neox": "query_key_value", "falcon": "query_key_value", "gpt2": "c_attn"}
NOT_LLAMA_LAYOUT = ("gpt2", "gpt_neox", "falcon")  # decoder layers elsewhere than model.model.layers
SHARED_ATTENTION = ("zamba2",)  # one attention module serving several layers, called without the layer: no statistics
RAGGED_LAYERS = ("adakv",)  # an eviction method whose layers hold KV heads of different lengths (RaggedLayer)
FULL_WIDTH_QK_NORM = ("olmo2", "olmo3")  # q_norm/k_norm over the whole projection, before the heads split
NO_POSITION_IDS = ("granitemoehybrid",)  # RoPE applied before its attention call, without position_ids there
NO_POSITIONS = ("gpt2", "nemotron_h", "jamba")  # absolute positions (GPT-2), or none in attention (Mamba's order)
ROPE_WORDS = {
    "none": "no rotary embedding (absolute positions, or none in its attention layers)",
    "partial": "a rotary embedding over part of the head",
    "per_layer_type": "a RoPE per layer type",
    "latent": "latent attention",
}


def _text(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def rope_kind(config) -> str:
    """standard | none | partial | per_layer_type | half (gpt-oss) | latent."""
    config = _text(config)
    kind = getattr(config, "model_type", "")
    rope = getattr(config, "rope_parameters", None) or {}
    if getattr(config, "kv_lora_rank", None):
        return "latent"
    if kind in NO_POSITIONS:
        return "none"
    if isinstance(rope, dict) and set(rope) & set(layout.SLIDING_TYPES + layout.GLOBAL_TYPES):
        return "per_layer_type"
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) if rope else 1.0
    if kind == "gpt_neox" or (factor or 1.0) < 1.0:
        return "partial"
    if kind == "gpt_oss":
        return "half"
    return "standard"


def _parts(method) -> list:
    """The method and the parts a composition stacks (methods/compose.py)."""
    if method.caps.family != "composite":
        return [method]
    return [method] + [p for p in (method.structure, method.eviction, method.precision) if p is not None]


def _needs_stats(part) -> bool:
    return bool(part.stats_request())  # decoding records what compressing reads (Compression.decode_request)


NEEDS = {  # Capabilities.needs (methods/base.py): what a method reads of the model beyond its cache
    "full_rope": "one rotary embedding over the whole head (its query moments)",
    "full_rope_width": "a rotary embedding over the whole head width (it rotates queries itself)",
    "qkv_projections": "separate q_proj/k_proj/v_proj under model.model.layers",
    "per_head_qk_norm": "q/k norms per head, if any (it re-derives queries with them)",
    "full_attention_layers": "full-attention layers only (transformers' QuantizedCache)",
    "kvbench_attention": "the model's attention to call kvbench's attention function (its packed cache)",
    "llama_layout": "decoder layers under model.model.layers with a self_attn each (where kvpress hooks)",
    "no_sliding_layers": "full-attention layers only (kvpress's presses treat a sliding layer's window as the prompt)",
}


def lacks(config) -> dict[str, str]:
    """The needs (NEEDS) a model with `config` does not meet, each with what it has instead."""
    config = _text(config)
    kind, rope = getattr(config, "model_type", ""), rope_kind(config)
    out = {}
    if rope not in ("standard", "half", "per_layer_type"):  # per layer type: each layer's own (model.attention)
        out["full_rope"] = f"has {ROPE_WORDS[rope]}"
    elif kind in NO_POSITION_IDS:
        out["full_rope"] = "does not pass position_ids to its attention layers"
    if rope in ("half", "partial", "none", "latent"):
        out["full_rope_width"] = "has a half-width rotary" if rope == "half" else f"has {ROPE_WORDS[rope]}"
    if kind in FUSED_QKV or kind in NOT_LLAMA_LAYOUT or rope == "latent":
        out["qkv_projections"] = f"has {FUSED_QKV.get(kind, 'latent projections')}"
    if kind in FULL_WIDTH_QK_NORM:
        out["per_head_qk_norm"] = "normalises q and k over the full projection width"
    if set(layout.layer_types(config)) & set(layout.SLIDING_TYPES):
        out["full_attention_layers"] = "has sliding-window layers: use kivi"
        out["no_sliding_layers"] = "has sliding-window layers"
    if kind in NOT_LLAMA_LAYOUT:
        out["llama_layout"] = "keeps its decoder layers elsewhere"
    if kind in SHARED_ATTENTION:
        out["full_rope"] = "runs one attention block shared by several layers (no query moments per layer)"
    if is_hybrid(config):  # linear-attention / Mamba / conv layers: no self_attn there, a state no method can re-run
        out["qkv_projections"] = "has linear-attention or state-space layers without them (a hybrid)"
        out["full_attention_layers"] = "has linear-attention or state-space layers: use kivi"
        out["llama_layout"] = "has decoder layers without self_attn (a hybrid)"
    if kind in NO_ATTENTION_INTERFACE:
        out["kvbench_attention"] = "runs its own attention: use hf-quant"
    return out


def is_hybrid(config) -> bool:
    """Whether some decoder layers keep a linear-attention, Mamba or convolution state (kvbench.model.states)."""
    return bool((set(STATE_TYPES) | set(HYBRID_TYPES)) & set(layout.layer_types(_text(config))))


def attention_with_state(config) -> bool:
    """Whether some decoder layers run attention and keep a Mamba state in one cache layer (Falcon-H1, Zamba2)."""
    return bool(set(HYBRID_TYPES) & set(layout.layer_types(_text(config))))


def own_cache_refusal(config) -> str | None:
    """Why kvbench does not run a model at all: a cache of its own (MiniMax) or beside the K/V (DeepSeek-V3.2's DSA
    indexer keys)."""
    kind = getattr(config, "model_type", "")
    if is_hybrid(config) and not HYBRID_CACHE:
        return (
            f"a hybrid model needs transformers ≥ 5.24, whose DynamicCache holds its linear-attention/Mamba states; "
            f"this is {transformers.__version__} (kvpress's venv pins 5.2): run it in kvbench's main venv"
        )
    if kind == "minimax":
        return "its model keeps a cache of its own, not transformers' DynamicCache, which kvbench compresses"
    if set(layout.INDEXED_TYPES) & set(layout.layer_types(config)):
        return (
            "its DSA indexer keeps a key cache of its own beside the latent (DeepSeek-V3.2), which kvbench does not "
            "yet carry through compression; python -m kvbench.plan sizes it"
        )
    return None


def refusal(method, config) -> str | None:
    """Why `method` (a built method) cannot run on a model with `config`, in one line; None when it can."""
    config = _text(config)
    kind = getattr(config, "model_type", "")
    model = type(config).__name__.removesuffix("Config")
    own_cache = own_cache_refusal(config)
    if own_cache:
        return f"method {method.name} cannot run on {model}: {own_cache}"
    if "shared" in layout.layer_types(config) and method.name != "full":
        return (
            f"method {method.name} cannot run on {model}: some of its layers reuse an earlier layer's K/V (Gemma 3n, "
            "Gemma 4), which kvbench does not yet compress consistently with the layer they read; its full cache runs"
        )
    rope = rope_kind(config)
    names = {part.name for part in _parts(method)}
    if rope == "latent" and not names <= set(POSITION_ONLY):
        return (
            f"method {method.name} cannot run on {model}: it has latent attention (MLA), whose cache holds one "
            f"latent shared by every head, not per-head K/V; methods that run on it: {', '.join(POSITION_ONLY)}"
        )
    needs_stats = any(_needs_stats(part) for part in _parts(method))
    if needs_stats and kind in SHARED_ATTENTION:
        return (
            f"method {method.name} needs attention statistics, but {model} runs one attention block shared by its "
            "hybrid layers, called without the layer it serves; use knorm, keydiff, random or streamingllm on it"
        )
    if needs_stats and kind in NO_ATTENTION_INTERFACE:
        return (
            f"method {method.name} needs attention statistics, but {model}'s attention does not go through "
            "transformers' AttentionInterface, where kvbench records them; use knorm, keydiff, random, "
            "streamingllm or decoding on it"
        )
    lacking = lacks(config)
    for part in _parts(method):
        for need in sorted(part.caps.needs & set(lacking)):
            return f"method {part.name} needs {NEEDS[need]}; {model} {lacking[need]}"
    own_layers = [p.name for p in _parts(method) if p.caps.family == "precision" or p.name in RAGGED_LAYERS]
    if own_layers and attention_with_state(config):
        return (
            f"method {own_layers[0]} holds K/V in cache layers of its own, but {model}'s hybrid layers keep attention "
            "and a Mamba state in one transformers layer; run an eviction method (snapkv, streamingllm, ...) on it"
        )
    counted = count_refusal(method, config)
    if counted:
        return counted
    for part in _parts(method):
        if part.name == "headmerge":  # knowable from the config: refused here, not after the model's conversion
            n_kv = layout.n_kv_heads(config)
            if not 1 <= part.kv_heads <= n_kv or n_kv % part.kv_heads:
                divisors = [d for d in range(1, n_kv + 1) if n_kv % d == 0]
                return (
                    f"headmerge kv_heads={part.kv_heads} does not divide {model}'s {n_kv} KV heads; give "
                    f"method.kv_heads= one of {', '.join(map(str, divisors))}"
                )
    for part in _parts(method):
        if part.name == "turboquant":  # vLLM's boundary protection: the first and last n layers stay full
            layers = len(layout.cache_layout(config, torch.float32).layers)
            if len(part.full_precision_layers(layers)) >= layers:
                return (
                    f"turboquant boundary_layers={part.resolved()['boundary_layers']} keeps all {layers} of {model}'s "
                    f"cache layers in full precision: it would compress nothing; give boundary_layers < {layers // 2}"
                )
    for part in _parts(method):
        group = getattr(part, "group_size", None)
        if part.name == "kivi" and group and layout.head_dim(config) % int(group):
            return (
                f"kivi group_size={group} does not divide {model}'s head_dim={layout.head_dim(config)}; "
                f"give method.group_size= a divisor of it"
            )
    return None


def budget_refusal(method, budget) -> str | None:
    """Why a token budget cannot run `method`, knowable from the configuration alone: fewer tokens than the method's
    minimum (its sinks and windows: `Method.min_tokens`), which `Method.layer_keep_counts` would refuse mid-run
    after the baseline. A fraction is not refused: on a short prompt it keeps the minimum instead."""
    if budget is None or not budget.is_tokens:
        return None
    evicting = [part for part in _parts(method) if part.caps.has_budget and part.caps.family != "composite"]
    for part in evicting or [method]:
        if budget.value < part.min_tokens():
            return (
                f"budget={int(budget.value)} tokens is fewer than {part.name} keeps at least ({part.min_tokens()}: "
                f"its sinks/windows); give budget ≥ {part.min_tokens()}, a fraction, or shrink its window"
            )
    return None


def context_of(config) -> int | None:
    """The model's context window in tokens (max_position_embeddings, GPT-2's n_positions), None where unstated."""
    config = _text(config)
    value = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def count_refusal(method, config) -> str | None:
    """A token count knob (`knob(..., tokens=True)`: future positions, evict_every, sinks, chunk sizes) beyond the
    model's context: positions the model never reads, and tensors or slots as long as the count."""
    import dataclasses

    context = context_of(config)
    if context is None:
        return None
    parts = _parts(method)
    parts += [p._scorer for p in parts if getattr(p, "_scorer", None) is not None]  # a wrapped scorer's own knobs
    for part in parts:
        for f in dataclasses.fields(part):
            value = getattr(part, f.name, None)
            if f.metadata.get("tokens") and isinstance(value, int) and value > context:
                model = type(_text(config)).__name__.removesuffix("Config")
                return (
                    f"{part.name} {f.name}={value:,} is beyond {model}'s context of {context:,} tokens "
                    f"(max_position_embeddings); give {f.name} ≤ {context:,}"
                )
    return None
