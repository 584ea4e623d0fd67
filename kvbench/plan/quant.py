"""Weight bytes of a checkpoint quantized on disk (its config's `quantization_config`), without loading it.

transformers quantizes the matrices of linear layers and of fused MoE experts (modules named `*Experts`), never the
embeddings, norms, biases or the LM head, nor a module `modules_to_not_convert` names (matched by transformers' own
`should_convert_module`). Each quantized element costs its bits plus its share of the scales kept beside it:

| quant_method | bits per quantized weight | source |
|---|---|---|
| mxfp4 (gpt-oss) | 4 + 8/32: an e2m1 value, one e8m0 scale per 32 (experts only) | OCP MX spec; transformers |
| fp8 | 8 + 32/(block_h · block_w): one fp32 scale per `weight_block_size` block | DeepSeek-V3's FP8 checkpoint |
| gptq, awq | bits + (16 + bits)/group_size: an fp16 scale and a packed zero per group | AutoGPTQ / AutoAWQ layouts |
| bitsandbytes | 4-bit: 4 + 32/64 (fp32 absmax per 64; double quant 4 + 8/64 + 32/16384); 8-bit: 8 | bitsandbytes |
| compressed-tensors | num_bits (+ 16/group_size for group strategies) of the weights' scheme | llm-compressor |

Everything else stays in the compute dtype. Unknown methods are refused in one line (a guess would plan another
model).
"""

from __future__ import annotations

from kvbench import KvbenchError

KNOWN = ("mxfp4", "fp8", "gptq", "awq", "bitsandbytes", "compressed-tensors")


def _number(value, name: str, method: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise KvbenchError(
            f"quantization_config.{name}={value} ({method}) is not a positive number; fix the checkpoint's config.json"
        )
    return float(value)


def quant_bits(qc: dict) -> tuple[str, float]:
    """(method, bits per quantized weight element, scales included) of a `quantization_config`."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "mxfp4":
        return method, 4 + 8 / 32
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block:
            return method, 8 + 32 / (_number(block[0], "weight_block_size", method) * _number(block[1], "", method))
        return method, 8.0
    if method in ("gptq", "awq"):
        bits = _number(qc.get("bits", qc.get("w_bit", 4)), "bits", method)
        group = qc.get("group_size", qc.get("q_group_size", 128))
        return method, bits + ((16 + bits) / _number(group, "group_size", method) if group != -1 else 0)
    if method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            return method, 4 + (8 / 64 + 32 / (64 * 256) if qc.get("bnb_4bit_use_double_quant") else 32 / 64)
        return method, 8.0
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if weights.get("num_bits"):
                bits = _number(weights["num_bits"], "config_groups.*.weights.num_bits", method)
                size = weights.get("group_size")
                return method, bits + (16 / _number(size, "group_size", method) if size else 0)
        raise KvbenchError(
            "quantization_config (compressed-tensors) has no config_groups with weights.num_bits; fix the config"
        )
    raise KvbenchError(
        f"quantization_config.quant_method={method or None} is not one the planner can count; known: "
        f"{', '.join(KNOWN)} (or remove quantization_config to plan the weights in the compute dtype)"
    )


def _skipped(name: str, patterns) -> bool:
    try:
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError:  # an older transformers: prefix or suffix match
        return any(name.startswith(p) or name.endswith(p) for p in patterns or [])
    return not should_convert_module(name, list(patterns) if patterns else None)


def quantized_params(model, qc: dict) -> int:
    """Weight elements of `model` (built on the meta device) that the checkpoint stores quantized."""
    import torch

    method = str(qc.get("quant_method", "")).lower()
    skip = qc.get("modules_to_not_convert") or []
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    count = 0
    for name, module in model.named_modules():
        experts = type(module).__name__.endswith("Experts")
        if module is output or _skipped(name, skip):
            continue
        if experts:
            count += sum(p.numel() for n, p in module.named_parameters(recurse=False) if p.dim() >= 2)
        elif isinstance(module, torch.nn.Linear) and method != "mxfp4":  # MXFP4 quantizes the experts only
            count += module.weight.numel()
    return count


def weights_bytes(n_params: int, quantized: int, element_bytes: int, bits: float | None) -> int:
    """Bytes of the weights: `quantized` elements at `bits` each, the rest at `element_bytes`."""
    if bits is None:
        return n_params * element_bytes
    return (n_params - quantized) * element_bytes + -(-int(quantized * bits) // 8)
