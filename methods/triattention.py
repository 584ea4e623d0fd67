"""TriAttention — keys scored by pre-RoPE query centres through a trigonometric series (Mao et al. 2026,
https://arxiv.org/abs/2604.04921; WeianMao/triattention, triattention/methods/triattention.py and pruning_utils.py).

Pre-RoPE queries of a head concentrate around a fixed centre. Writing each RoPE frequency pair f of a vector as a
complex number (x_f + i·x_{f+D/2}, transformers' rotate_half layout), the logit of a query at position p on a key at
position j is Re Σ_f q_f · conj(k_f) · e^{iω_f(p−j)}. With the query replaced by its calibrated centre E[q], a
pre-RoPE key k (the cached key rotated back by its position) scores, per query head (the code's
score_keys_for_round and compute_frequency_statistics_from_means):

    S(k) = mean_o  Σ_f |E[q_f]|·|k_f| · s² · cos(ω_f·(p + o − j) + φ_f)  +  Σ_f (E|q_f| − |E[q_f]|)·|k_f| · s²

with φ_f = arg(E[q_f]·conj(k_f)), s the RoPE attention scaling, p the next position (the prompt's length) and o over
the geometric offsets 1, 2, 4, ... ≤ `offset_max_length` (`aggregation=mean`, or max). The first term is the
expected logit of the query centre at those future distances (the trigonometric series); the second, the norm term,
the part of the query's mean length its centre leaves out (`use_norm_term=false` drops it). A KV head takes the max
over its query group (the code's per-layer-per-head pruning, `layer_perhead_aggregation=max`; `normalize=true`
z-scores each query head first, its `normalize_scores`). The last `window_size` prompt tokens are always kept
(the code protects recent decode tokens by compressing every `divide_length` steps; here the prompt is compressed
once). Implemented from the authors' code; the paper's equations were not readable here, so the formula above is the
code's.

Calibration: E[q_f] and E|q_f| per layer and query head, from the pre-RoPE queries of `calib_prompts` prompts of
`calib_tokens` tokens of kvbench's own offline prose (the Python reference shipped with CPython,
kvbench.tasks.haystack.python_docs_prose), computed on the model in use on first use and cached under
$KVBENCH_CACHE/triattention/ (the knobs are part of the config hash; nothing is downloaded). The authors calibrate
on a few reasoning traces of the model (a stats file per model); any text the model reads works the same way.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

import torch

from kvbench import KvbenchError, cache_root
from kvbench.config.registry import knob
from kvbench.methods.base import METHODS, Capabilities, Method, check_choice
from kvbench.model.attention import cache_index
from kvbench.model.rope import rerotate

CALIBRATION_ATTENTION = "kvbench_triattention_calibration"


@dataclass
class Centres:
    """Per layer: E[q_f] (H_q, F) complex64, E|q_f| (H_q, F) fp32, inv_freq (F,) and the RoPE attention scaling."""

    mean: dict[int, torch.Tensor]
    abs_mean: dict[int, torch.Tensor]
    inv_freq: dict[int, torch.Tensor]
    scaling: dict[int, float]


def complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """(..., D) real → (..., D/2) complex: x_f + i·x_{f+D/2} (rotate_half pairs dimension f with f + D/2)."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half].float(), x[..., half:].float())


def trig_scores(
    keys_pre: torch.Tensor,
    positions: torch.Tensor,
    next_position: int,
    centre: torch.Tensor,
    abs_centre: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    offsets: torch.Tensor,
    aggregation: str = "mean",
    norm_term: bool = True,
) -> torch.Tensor:
    """Pre-RoPE keys (T, D) of one KV head at `positions` (T,), one query head's centre E[q] (F,) complex and E|q|
    (F,) → (T,) scores S(k) (module docstring)."""
    k = complex_pairs(keys_pre)  # (T, F)
    k_abs = k.abs()
    relative = centre[None, :] * k.conj()  # (T, F)
    amp, phase = relative.abs(), relative.angle()  # |E q|·|k|, φ
    scale = scaling**2
    delta = (next_position - positions.float())[:, None] + offsets[None, :]  # (T, O)
    angle = delta[:, :, None] * inv_freq[None, None, :] + phase[:, None, :]  # (T, O, F)
    series = (amp[:, None, :] * scale * torch.cos(angle)).sum(-1)  # (T, O)
    combined = series.mean(-1) if aggregation == "mean" else series.amax(-1)  # (T,)
    if norm_term:
        combined = combined + ((abs_centre - centre.abs())[None, :] * k_abs * scale).sum(-1)
    return combined


def geometric_offsets(max_length: int) -> torch.Tensor:
    """1, 2, 4, ... ≤ max_length (the code's build_geometric_offsets)."""
    return torch.tensor([float(2**i) for i in range(int(math.log2(max_length)) + 1)])


@METHODS.register("triattention")
@dataclass
class TriAttention(Method):
    window_size: int = knob(32, min=0, tokens=True)  # the newest prompt tokens, always kept
    offset_max_length: int = knob(65536, min=1)  # future distances 1, 2, 4, ... up to this
    aggregation: str = knob("mean", choices=("mean", "max"))  # over the future distances
    normalize: bool = False  # z-score each query head's scores before the group's max (the code's normalize_scores)
    use_norm_term: bool = True  # add the (E|q| − |E q|)·|k| term (the code's MLR; false: its disable_mlr)
    calib_prompts: int = knob(4, min=1)  # calibration prompts of kvbench's offline prose
    calib_tokens: int = knob(512, min=16, tokens=True)  # tokens per calibration prompt

    # pre-RoPE queries through the model's rotary embedding, recorded in kvbench's attention function
    caps = Capabilities(
        needs=frozenset({"full_rope", "kvbench_attention"}),
        chunk_limit="its scores need each key's prompt position",
        stream_limit="use snapkv",
    )

    def __post_init__(self):
        check_choice("aggregation", self.aggregation, ("mean", "max"))
        self._centres: Centres | None = None
        self._model_key: str | None = None

    def min_tokens(self) -> int:
        return self.window_size + 1

    # ---- calibration ---------------------------------------------------------------------------------------
    def bind(self, lm) -> None:
        key = calibration_key(lm, self.calib_prompts, self.calib_tokens)
        if self._model_key != key:
            self._centres, self._model_key = load_or_calibrate(lm, key, self.calib_prompts, self.calib_tokens), key

    def centres(self, stats) -> Centres:
        """The bound model's calibration; a prefill that recorded its model (stats.prompt) binds it here."""
        if self._centres is None and getattr(stats, "prompt", None) is not None:
            self.bind(stats.prompt.lm)
        if self._centres is None:
            raise KvbenchError("triattention scores need the model's calibration: bind(lm) first (the engine does)")
        return self._centres

    # ---- scores --------------------------------------------------------------------------------------------
    def scores(self, layer_idx, keys, values, stats):
        """Per KV head the max over its query group of S(k) (B, H_kv, T); +inf on the window."""
        c = self.centres(stats)
        bsz, n_kv_heads, n_tokens, _ = keys.shape
        inv_freq = c.inv_freq[layer_idx].to(keys.device)
        positions = torch.arange(n_tokens, device=keys.device)
        keys_pre = rerotate(keys.float(), -positions, inv_freq) / c.scaling[layer_idx]  # (B, H_kv, T, D)
        centre, abs_centre = c.mean[layer_idx].to(keys.device), c.abs_mean[layer_idx].to(keys.device)  # (H_q, F)
        group = centre.shape[0] // n_kv_heads
        offsets = geometric_offsets(self.offset_max_length).to(keys.device)
        out = keys.new_empty(bsz, n_kv_heads, n_tokens, dtype=torch.float32)
        for b in range(bsz):
            for h in range(n_kv_heads):
                per_query = torch.stack(
                    [
                        trig_scores(
                            keys_pre[b, h],
                            positions,
                            n_tokens,
                            centre[q],
                            abs_centre[q],
                            inv_freq,
                            c.scaling[layer_idx],
                            offsets,
                            self.aggregation,
                            self.use_norm_term,
                        )
                        for q in range(h * group, (h + 1) * group)
                    ]
                )  # (G, T)
                if self.normalize:
                    per_query = (per_query - per_query.mean(-1, keepdim=True)) / per_query.std(
                        -1, unbiased=False, keepdim=True
                    ).clamp_min(1e-6)
                out[b, h] = per_query.amax(0)
        if self.window_size:
            out[..., max(0, n_tokens - self.window_size) :] = float("inf")
        return out


def calibration_key(lm, n_prompts: int, n_tokens: int) -> str:
    """The cache file's name: the model (name, dtype, its config) and the calibration's knobs."""
    config = lm.model.config.to_json_string(use_diff=False)
    digest = hashlib.sha256(f"{lm.name}|{lm.dtype}|{config}|{n_prompts}|{n_tokens}".encode()).hexdigest()[:16]
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', str(lm.name))}-{n_prompts}x{n_tokens}-{digest}"


def calibration_prompts(tokenizer, n_prompts: int, n_tokens: int) -> list[list[int]]:
    """`n_prompts` token lists of `n_tokens` each, consecutive stretches of the offline prose."""
    from kvbench.tasks.haystack import python_docs_prose

    ids = tokenizer(" ".join(python_docs_prose()[:4000]))["input_ids"]
    if len(ids) < n_prompts * n_tokens:
        raise KvbenchError(
            f"triattention: the calibration prose has {len(ids)} tokens, fewer than calib_prompts × calib_tokens = "
            f"{n_prompts * n_tokens}; lower method.calib_tokens"
        )
    return [ids[i * n_tokens : (i + 1) * n_tokens] for i in range(n_prompts)]


def load_or_calibrate(lm, key: str, n_prompts: int, n_tokens: int) -> Centres:
    path = cache_root() / "triattention" / f"{key}.pt"
    if path.exists():
        try:
            saved = torch.load(path, map_location="cpu")
            return Centres(**saved)
        except Exception as error:  # a damaged file: one line naming it
            raise KvbenchError(
                f"triattention calibration {path} cannot be read ({type(error).__name__}); delete it to recompute"
            ) from None
    centres = calibrate(lm, calibration_prompts(lm.tokenizer, n_prompts, n_tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(vars(centres), path)
    return centres


def calibrate(lm, prompts: list[list[int]]) -> Centres:
    """E[q_f], E|q_f| per layer and query head over every position of `prompts`, from the post-RoPE queries
    kvbench's attention function receives, rotated back by their positions (each prompt a fresh forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from kvbench.model.attention import kvbench_sdpa, register, rope_of

    sums: dict[int, list] = {}  # layer → [Σ q_f complex (H_q, F), Σ |q_f| (H_q, F), count, inv_freq, scaling]

    def recording(module, query, key, value, attention_mask, **kwargs):
        inv_freq, scaling = rope_of(module)
        positions = torch.arange(query.shape[2], device=query.device)  # a fresh prompt: positions 0..Q−1
        pre = complex_pairs(rerotate(query.float(), -positions, inv_freq.to(query.device)) / scaling)  # (B, H_q, Q, F)
        entry = sums.setdefault(cache_index(module), [0, 0, 0, inv_freq.cpu(), scaling])
        entry[0] = entry[0] + pre.sum((0, 2)).cpu()
        entry[1] = entry[1] + pre.abs().sum((0, 2)).cpu()
        entry[2] += pre.shape[0] * pre.shape[2]
        return kvbench_sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CALIBRATION_ATTENTION, recording)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CALIBRATION_ATTENTION, sdpa_mask)
    lm.model.set_attn_implementation(CALIBRATION_ATTENTION)
    try:
        with torch.no_grad():
            for ids in prompts:
                lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=False)
    finally:
        lm.model.set_attn_implementation(register())
    if not sums:
        raise KvbenchError("triattention: the calibration recorded no queries (the model's attention bypasses kvbench)")
    return Centres(
        mean={layer: s[0] / s[2] for layer, s in sums.items()},
        abs_mean={layer: s[1] / s[2] for layer, s in sums.items()},
        inv_freq={layer: s[3] for layer, s in sums.items()},
        scaling={layer: float(s[4]) for layer, s in sums.items()},
    )
