"""Attention statistics computed from Q and K in chunks, never materialising the full T × T attention matrix.

One function serves every eviction method:
- SnapKV / PyramidKV: the observation window's attention onto each position = column sums over the last W queries;
- H2O: attention each key has received from every query so far = column sums over all queries (prefill), then the
  single new query's row at every decode step.

The softmax is the one the model computes: with the model's attention mask when it passes one (sliding windows —
Mistral v0.1, Gemma-2/3, Qwen2 — and padding live there), causal by position otherwise (what sdpa does without a
mask), and with the logits soft-capped, cap·tanh(s / cap), when the model caps them (Gemma-2).
"""

from __future__ import annotations

import torch

from kvbench.kernels.backend import backend

# Query rows (query heads of one KV head × queries) per chunk of scores: the score tile (rows × T fp32, 2 MiB at 4K
# tokens) stays in cache and each matmul is large enough to be efficient. Measured (bundled model's shapes, 2 cores,
# one layer): 128 rows 136 ms at 4K and 634 ms at 8K, vs 375 ms and 2,994 ms with 2^19-element chunks (14 queries)
# and with exp in place of exp2.
_SCORE_ROWS = 128
# Scores are kept in log2 units (the scaling × log2(e) folded into the query) because exp2 runs ~3× faster than exp
# on this CPU's vectorised kernels, and 2^(s·log2 e) = e^s.
_LOG2E = 1.4426950408889634


def attention_column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Σ over queries of softmax(q·kᵀ·scaling), per query head, in fp32.

    query: (B, H_q, Q, D), the last Q positions of a sequence whose keys are key: (B, H_kv, T, D), T ≥ Q.
    mask: the attention mask the model passed, (B or 1, 1 or H_q, Q, T) — bool (True = attend) or additive float;
    None = causal (query i sees keys up to T − Q + i). softcap: logits → softcap·tanh(logits / softcap) before the
    mask, as Gemma-2's attention does.
    GQA: query head h reads KV head h // (H_q / H_kv) (transformers' repeat_kv order); K is never expanded: the G
    query heads of a KV head are stacked as rows of one (G·C × D)·(D × T) product.
    Returns (B, H_q, T): how much attention each key position received from these queries.
    """
    bsz, n_q_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys = key.shape[1], key.shape[2]
    group = n_q_heads // n_kv_heads
    q = query.reshape(bsz, n_kv_heads, group, n_queries, head_dim)  # (B, H_kv, G, Q, D)
    # QKᵀ in the model's dtype, as eager attention (and so the H2O and kvpress code reading its weights) computes it:
    # bf16/fp16 products with fp32 accumulation, 2.2× faster than fp32 products on this CPU; softmax and sums in fp32
    product_dtype = key.dtype if key.dtype in (torch.bfloat16, torch.float16) else torch.float32
    out = torch.zeros(bsz, n_kv_heads, group, n_keys, dtype=torch.float32, device=query.device)
    # the whole loop below in one C call (the CPU backend's, kvbench/kernels/cpu/column_sums.py), causal and uncapped;
    # inconsistent shapes: torch's loop says why. The scaled query is rounded as eager attention rounds it; bf16 × bf16
    # is exact in fp32, so both C paths are the bf16 product with fp32 accumulation
    whole = mask is None and softcap is None and n_queries <= n_keys and key.shape[-1] == head_dim
    cpu = backend("cpu") if whole and query.device.type == "cpu" else None
    if cpu is not None:
        rows = (q.float() * (scaling * _LOG2E)).to(product_dtype).contiguous()  # (B, H_kv, G, Q, D) log2
        if cpu.causal_column_sums(rows, key, out):
            return out.reshape(bsz, n_q_heads, n_keys)
    keys_t = key.to(product_dtype).transpose(-1, -2).contiguous()  # (B, H_kv, D, T): faster products than Kᵀ views
    chunk = max(1, _SCORE_ROWS // group)
    first_query_pos = n_keys - n_queries
    for start in range(0, n_queries, chunk):
        q_chunk = q[:, :, :, start : start + chunk].float()  # (B, H_kv, G, C, D)
        n_chunk = q_chunk.shape[3]
        # without a mask, keys after the chunk's last query are all masked: skip them
        visible = n_keys if mask is not None else first_query_pos + start + n_chunk
        if softcap is None:  # scaling and log2(e) folded into the (small) query chunk: no pass over the scores
            rows = (q_chunk * (scaling * _LOG2E)).reshape(bsz, n_kv_heads, group * n_chunk, head_dim)
            scores = torch.matmul(rows.to(product_dtype), keys_t[..., :visible]).float()  # (B, H_kv, G·C, t) log2
        else:
            rows = q_chunk.reshape(bsz, n_kv_heads, group * n_chunk, head_dim).to(product_dtype)  # (B, H_kv, G·C, D)
            scores = torch.matmul(rows, keys_t[..., :visible]).float()  # (B, H_kv, G·C, t)
            scores.mul_(scaling / softcap).tanh_().mul_(softcap * _LOG2E)
        per_head = scores.view(bsz, n_kv_heads, group, n_chunk, visible)  # (B, H_kv, G, C, t)
        if mask is None:  # causal: only the last C keys can lie after a query of the chunk
            query_pos = first_query_pos + start + torch.arange(n_chunk, device=query.device)  # (C,)
            tail = torch.arange(visible - n_chunk, visible, device=query.device)  # (C,) the last C keys
            per_head[..., visible - n_chunk :].masked_fill_(tail[None, :] > query_pos[:, None], float("-inf"))
        else:
            _apply_mask(per_head, mask[:, :, start : start + n_chunk], n_kv_heads, group)
        # softmax column sums without normalising every element: Σ_i 2^(s_ij − m_i) / l_i is a (1 × C)·(C × t)
        # product per head, the 1/l_i folded into its left operand (a fully masked row, padding, adds nothing)
        row_max = scores.amax(dim=-1, keepdim=True)  # (B, H_kv, G·C, 1)
        scores.sub_(row_max.nan_to_num_(0.0, posinf=0.0, neginf=0.0)).exp2_()  # in place: no chunk-sized buffers
        inv_total = per_head.sum(dim=-1).reciprocal_()  # (B, H_kv, G, C); 1/0 = inf: masked rows
        inv_total.masked_fill_(inv_total.isinf(), 0.0)
        out[..., :visible] += torch.matmul(inv_total.unsqueeze(-2), per_head).squeeze(-2)  # (B, H_kv, G, t)
    return out.reshape(bsz, n_q_heads, n_keys)


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor, n_kv_heads: int, group: int) -> None:
    """Mask scores (B, H_kv, G, C, T), in log2 units, in place with the model's mask rows (B|1, 1|H_q, C, T)."""
    if mask.shape[1] == 1:
        mask = mask.unsqueeze(1)  # (B|1, 1, 1, C, T)
    else:
        mask = mask.reshape(mask.shape[0], n_kv_heads, group, *mask.shape[2:])  # (B|1, H_kv, G, C, T)
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    else:
        scores.add_(mask.float() * _LOG2E)  # an additive mask is in natural-log units


def decode_attention_with_probs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence, no mask: the attention output and its probabilities from one softmax.

    query (B, H_q, 1, D), key/value (B, H_kv, T, D) → output (B, 1, H_q, D) in query's dtype (as transformers'
    attention functions return it) and the probabilities (B, H_q, T) fp32 — for a single query these are the
    column sums `attention_column_sums` records, so a decode step that records statistics (H2O, TOVA) computes
    q·Kᵀ and the softmax once instead of once in sdpa and again for the statistics. fp32 throughout.
    """
    bsz, n_q_heads, _, head_dim = query.shape  # (B, H_q, 1, D)
    n_kv_heads = key.shape[1]
    q = query.reshape(bsz, n_kv_heads, n_q_heads // n_kv_heads, head_dim).float() * scaling  # (B, H_kv, G, D)
    probs = torch.matmul(q, key.float().transpose(-1, -2)).softmax(dim=-1)  # (B, H_kv, G, T)
    out = torch.matmul(probs, value.float())  # (B, H_kv, G, D)
    out = out.reshape(bsz, n_q_heads, 1, head_dim).transpose(1, 2).to(query.dtype)  # (B, 1, H_q, D)
    return out, probs.reshape(bsz, n_q_heads, -1)
