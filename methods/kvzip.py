"""KVzip — query-agnostic eviction by context reconstruction (Kim et al. 2025, https://arxiv.org/abs/2505.23416;
kvpress's KVzipPress).

After the prefill the model is asked to repeat its prompt: a second forward, on top of the prefilled cache, over
"Repeat the previous context exactly." + the chat template's turn switch + the prompt's tokens again. A KV pair's
score is the largest attention any of these reconstruction queries of its KV head's group pays it; each KV head
keeps its top scores (`adakv scorer=kvzip alpha_safeguard=0` shares a layer's budget across its heads instead, as
kvpress's `layerwise=True`; kvpress's default ranks all layers together, which kvbench does not offer).
The first `n_sink` positions are always kept and are not repeated; everything after them is. kvpress repeats only
what follows the chat template's opening (system prompt, user header: its positions after the sinks score 0 and go
first): `skip_template=true`, with which `adakv scorer=kvzip alpha_safeguard=0 'scorer_params={skip_template:
true}'` keeps what KVzipPress(layerwise=True) keeps (tests/kvpress). Prompts longer than `chunk_size` are repeated
chunk by chunk as kvpress does: each chunk's forward runs on the prefilled cache alone, starts with "Repeat the part
of the previous context exactly, starting with" + the previous chunk's last 8 tokens, and normalises its attention
over the sinks, the chunk and itself.

Cost: the second forward is as long as the prompt again (+ ~20 tokens per chunk) and attends to up to twice the
keys; it is part of the configuration's compression time, so its `prefill_s` shows it. One reconstruction per
prefill serves every budget of a grid (and the fidelity columns' rebuilds) with the same knobs; each row is charged
its time and peak as if it had run its own (`PromptSource.derive`). Queries are rebuilt from q_proj on the
attention modules' inputs (forward hooks, as kvpress does); the logits are products in the model's dtype, the
softmax is computed in query chunks in fp32 — the model's own attention stays sdpa.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench import KvbenchError
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, Method
from kvbench.model.rope import rotate_half

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk that lead each later chunk (kvpress's prev_postfix_size)
QUERY_BLOCK = 256  # reconstruction queries per softmax block (bounds the (H_q, Q, keys) temporary)


def template_parts(tokenizer) -> tuple[list[int], list[int]]:
    """The chat template's tokens before a user message's content (its opening: system prompt, user header) and
    between the message and the assistant's answer (kvpress's suffix); ([], "\n") without a template."""
    if tokenizer.chat_template is None:
        return [], tokenizer.encode("\n", add_special_tokens=False)
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False
    )
    head, switch = text.split(separator)
    encode = lambda piece: tokenizer.encode(piece, add_special_tokens=False)
    return encode(head.split(dummy)[0]), encode(switch)


def max_attention(query: torch.Tensor, keys: torch.Tensor, scaling: float, n_scored: tuple[int, int]) -> torch.Tensor:
    """query (B, H_q, R, D) post-RoPE; keys (B, H_kv, S + C + R, D) = sinks, scored chunk, the queries' own keys.
    The softmax over those keys (causal among the last R); returns the max over queries and over each KV head's
    query group of the attention paid to keys [start, stop) = the chunk: (B, H_kv, C) fp32."""
    bsz, n_heads, n_queries, head_dim = query.shape
    n_kv = keys.shape[1]
    start, stop = n_scored
    keys_t = keys.to(query.dtype).transpose(-1, -2)[:, :, None]  # (B, H_kv, 1, D, K)
    n_keys = keys.shape[2]
    own = torch.arange(n_keys - n_queries, n_keys, device=query.device)  # (R,) the queries' own key slots
    best = torch.zeros(bsz, n_kv, stop - start, device=query.device)
    for first in range(0, n_queries, QUERY_BLOCK):
        q = query[:, :, first : first + QUERY_BLOCK]  # (B, H_q, r, D)
        q = q.view(bsz, n_kv, n_heads // n_kv, q.shape[2], head_dim)  # (B, H_kv, G, r, D)
        # the products in the model's dtype (as its attention and kvpress: bf16 5× fp32's speed on this CPU),
        # the softmax in fp32
        logits = (q @ keys_t).float() * scaling  # (B, H_kv, G, r, K)
        future = own[None, :] > own[first : first + q.shape[3], None]  # (r, R) later reconstruction tokens
        logits[..., n_keys - n_queries :].masked_fill_(future, float("-inf"))
        weights = logits.softmax(dim=-1)[..., start:stop]  # (B, H_kv, G, r, C)
        best = torch.maximum(best, weights.amax(dim=(2, 3)))  # (B, H_kv, C)
    return best


@METHODS.register("kvzip")
@dataclass
class KVzip(Method):
    # prefill=inline / prefill_chunk cannot serve it: the reconstruction needs the whole prompt's K/V in every layer
    caps = Capabilities(
        compresses_inline=False,
        chunk_limit="its reconstruction forward re-reads the whole prefilled prompt",
        needs=frozenset(
            {"qkv_projections", "per_head_qk_norm", "full_rope_width"}
        ),  # re-derives and rotates queries itself
    )

    n_sink: int = knob(4, tokens=True)  # first positions always kept, not repeated
    chunk_size: int = knob(
        2048, min=1, tokens=True
    )  # prompt tokens repeated per reconstruction forward (kvpress's chunk_size)
    # true: as kvpress's KVzipPress, the chat template's opening (system prompt, user header) is not repeated and
    # its positions after the sinks score 0, evicted first; false: everything after the sinks is repeated
    skip_template: bool = False

    def __post_init__(self):
        if self.n_sink < 0 or self.chunk_size < 1:
            raise KvbenchError(f"kvzip: n_sink={self.n_sink} must be ≥ 0 and chunk_size={self.chunk_size} ≥ 1")

    def min_tokens(self) -> int:
        return self.n_sink + 1

    def scores(self, layer_idx, keys, values, stats):
        prompt = getattr(stats, "prompt", None)
        if prompt is None:
            raise KvbenchError(
                "kvzip re-reads the whole prompt after its prefill: not available here (a prefix reused from the "
                "prefix cache, or re-scoring while decoding); use another scorer"
            )
        # one reconstruction per prefill serves every layer, and every budget of a grid with the same knobs
        key = ("kvzip", self.n_sink, self.chunk_size, self.skip_template)
        return prompt.derive(key, lambda: self.reconstruction_scores(prompt))[layer_idx]  # (B, H_kv, T)

    def reconstruction_scores(self, prompt) -> list[torch.Tensor]:
        """Every layer's (B, H_kv, T) scores: max reconstruction attention, +inf on the sinks."""
        lm, ids, kv = prompt.lm, prompt.ids, prompt.kv
        if kv[0][0].shape[0] != 1:
            raise KvbenchError("kvzip reconstructs one prompt at a time (batch size 1)")
        n_prompt = len(ids)
        scores = [torch.zeros(1, k.shape[1], n_prompt, device=k.device) for k, _ in kv]  # per layer (1, H_kv, T)
        tokenizer = lm.tokenizer
        opening, switch = template_parts(tokenizer)
        # kvpress starts at the template's opening length, whatever the sinks (kvzip_press.py: start_idx)
        first = len(opening) if self.skip_template else self.n_sink
        starts = range(first, n_prompt, self.chunk_size)
        for i, start in enumerate(starts):
            stop = min(start + self.chunk_size, n_prompt)
            lead_ids = tokenizer.encode(FIRST_PROMPT if i == 0 else NEXT_PROMPT, add_special_tokens=False)
            lead_ids += ids[max(start - OVERLAP, 0) : start] if i else []  # later chunks: where to start from
            chunk_scores = self._reconstruct(lm, kv, lead_ids + switch + ids[start:stop], (start, stop))
            for layer, chunk in zip(scores, chunk_scores):
                layer[..., start:stop] = chunk
        for layer in scores:
            layer[..., : self.n_sink] = float("inf")
        return scores

    @torch.inference_mode()
    def _reconstruct(self, lm, kv, repeat_ids: list[int], span: tuple[int, int]) -> list[torch.Tensor]:
        """One reconstruction forward of `repeat_ids` on a cache holding the prefill `kv` (the prefill's tensors are
        not modified: the cache appends into new ones). Returns per layer (1, H_kv, stop − start)."""
        from transformers import DynamicCache

        from kvbench.model.cache import kv_layer

        n_prompt = kv[0][0].shape[2]
        start, stop = span
        n_sink = min(self.n_sink, start)
        cache = DynamicCache()
        cache.layers = [kv_layer(k, v) for k, v in kv]
        found: dict[int, torch.Tensor] = {}

        def hook(module, args, kwargs, output):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (1, R, hidden)
            cos, sin = kwargs["position_embeddings"]  # (1, R, D) each
            query = module.q_proj(hidden).view(*hidden.shape[:2], -1, module.head_dim)  # (1, R, H_q, D)
            if hasattr(module, "q_norm"):  # Qwen3-style query norm, before RoPE
                query = module.q_norm(query)
            query = query.transpose(1, 2)  # (1, H_q, R, D)
            query = query * cos[:, None] + rotate_half(query) * sin[:, None]  # post-RoPE
            keys = cache.layers[module.layer_idx].keys  # (1, H_kv, T + R, D)
            picked = torch.cat([keys[:, :, :n_sink], keys[:, :, start:stop], keys[:, :, n_prompt:]], dim=2)
            found[module.layer_idx] = max_attention(query, picked, module.scaling, (n_sink, n_sink + stop - start))

        layers = lm.model.model.layers
        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
        try:
            lm.forward(repeat_ids, list(range(n_prompt, n_prompt + len(repeat_ids))), cache)
        finally:
            for handle in hooks:
                handle.remove()
        return [found[i] for i in range(len(kv))]
