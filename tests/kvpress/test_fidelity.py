"""Fidelity: kvbench's native methods against their kvpress presses on the bundled model (fp32, kvbench's NIAH
prompt), the same positions kept in every layer and KV head at matched settings — or the difference documented in
docs/methods.md "Method correctness". `python -m tests.kvpress.test_fidelity` prints the table.

Both sides see one prompt: the native method compresses kvbench's shared prefill; the press runs by its own hooks
(methods/kvpress.py) on a fresh prefill. Kept positions are found by each held key's fingerprint (a gather copies a
key's bytes), and for head-wise presses from kvpress's masked indices. Budgets are token counts, as kvpress rounds
down (int(T · (1 − ratio))) where kvbench rounds.
"""

from __future__ import annotations

from unittest import mock

import pytest

from tests.kvpress.conftest import NO_KVPRESS

pytest.importorskip("kvpress", reason=NO_KVPRESS)
import torch
from transformers import DynamicCache

from kvbench.methods import Budget, build_method
from kvbench.methods import kvpress as kvpress_adapter
from kvbench.methods.base import Method
from kvbench.methods.kvpress import compression_ratio, fingerprint, kept_mask_of
from kvbench.model.ragged import RaggedLayer

pytestmark = pytest.mark.real_model

# (native method, its params, the press, how the selections relate at these settings):
#   "identical"     every layer and KV head keeps the same positions
#   "ties"          the same count in every layer and head; positions differ only among equal scores (top-k keeps
#                   vs bottom-k prunes: torch breaks ties in each its own way)
#   "layer_counts"  the same total, other per-layer counts (the documented difference), hence other positions
SKIP_TEMPLATE = {"skip_template": True}  # kvpress's KVzip repeats what follows the chat template's opening
PAIRS = [
    ("knorm", {}, "KnormPress", "identical"),
    ("keydiff", {}, "KeyDiffPress", "identical"),
    ("snapkv", {"window_size": 32}, {"name": "SnapKVPress", "window_size": 32}, "identical"),
    ("streamingllm", {"start_size": 4}, {"name": "StreamingLLMPress", "n_sink": 4}, "identical"),
    ("tova", {}, "TOVAPress", "identical"),
    ("expected_attention", {}, "ExpectedAttentionPress", "identical"),
    # kvpress's H2O-like press reads eager weights (methods/kvpress.py runs its prefill eager); kvbench's h2o at
    # the prompt with kvpress's normalisation (the attention each key received ÷ the queries that saw it) and
    # without the paper's recent window, which kvpress does not keep
    ("h2o", {"score": "mean", "recent_ratio": 0.0}, "ObservedAttentionPress", "identical"),
    (
        "adakv",
        {"scorer": "snapkv"},
        {"name": "AdaKVPress", "press": {"name": "SnapKVPress", "window_size": 32}},
        "identical",
    ),
    # layer 0's keys of a repeated token have one norm: AdaKV's boundary falls inside such ties
    ("adakv", {"scorer": "knorm"}, {"name": "AdaKVPress", "press": "KnormPress"}, "ties"),
    # layerwise=True shares a layer's budget over its heads (alpha_safeguard=0); kvpress counts it by pruning
    # int(H·T·ratio), so its ratio is given exactly (PRUNES)
    (
        "adakv",
        {"scorer": "kvzip", "alpha_safeguard": 0.0, "scorer_params": SKIP_TEMPLATE},
        {"name": "KVzipPress", "layerwise": True},
        "identical",
    ),
    # kvpress's default ranks every layer's scores together (layerwise=False); kvbench keeps n per KV head: the
    # same scores (skip_template), other per-layer counts
    ("kvzip", SKIP_TEMPLATE, "KVzipPress", "layer_counts"),
    # kvpress builds its pyramid on (budget + window) and counts the window inside each layer's count;
    # KVCache-Factory (and kvbench) on the budget, the window on top: other per-layer counts, same total
    ("pyramidkv", {"window_size": 32}, {"name": "PyramidKVPress", "window_size": 32}, "layer_counts"),
]
PRUNES = ("KVzipPress",)  # presses that count what they prune, int(H·T·ratio), not what they keep
SHARES = (0.25, 0.5)


def native_masks(engine, ids, name, params, n_keep) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Per layer (1, H_kv, T) bool: the positions the native method's compressed cache holds; and its (1, H_kv, T)
    scores where it has any (the scorer's, for a wrapper)."""
    method = build_method(name, params)
    prefill = engine.prefill(list(ids), method.stats_request())
    cache = engine.compressed(prefill, method, Budget(n_keep), []).cache
    scorer = getattr(method, "_scorer", method)
    masks, scores = [], []
    for i, ((keys, values), layer) in enumerate(zip(prefill.kv, cache.layers)):
        before = fingerprint(keys)  # (1, H_kv, T)
        if isinstance(layer, RaggedLayer):  # head-wise: each head's run of the flat keys on its own
            heads = layer.flat_keys.split(layer.lengths)  # per (b, h): (T_bh, D)
            rows = [kept_mask_of(before[:, h : h + 1], k[None, None]) for h, k in enumerate(heads)]
            masks.append(torch.cat(rows, dim=1))
        else:
            masks.append(kept_mask_of(before, layer.keys))
        has_scores = type(scorer).scores is not Method.scores
        scores.append(scorer.scores(i, keys, values, prefill.stats) if has_scores else None)
    return masks, scores


def press_masks(lm, ids, press, n_keep) -> list[torch.Tensor]:
    method = build_method("kvpress", {"press": press})
    exact = (len(ids) - n_keep) / len(ids) + 1e-9  # int(H·T·ratio) = H·(T − n) despite float rounding
    name = press if isinstance(press, str) else press["name"]
    ratio = (lambda budget, n_prompt: exact) if name in PRUNES else compression_ratio
    with mock.patch.object(kvpress_adapter, "compression_ratio", ratio):
        with method.hooked_prefill(lm, len(ids), Budget(n_keep)):
            lm.forward(list(ids), list(range(len(ids))), DynamicCache())
    with method.hooked_decode(lm):  # takes kvpress's masks off the model again
        pass
    return method.kept_masks


def only_ties_differ(ours, theirs, scores) -> bool:
    """Every layer-head keeps as many positions on both sides, and where the positions differ they share one score."""
    for a, b, s in zip(ours, theirs, scores):
        if s is None or not torch.equal(a.sum(-1), b.sum(-1)):
            return False
        for (batch, head), differ in zip(torch.cartesian_prod(*map(torch.arange, a.shape[:2])), (a != b).flatten(0, 1)):
            if differ.any() and s[batch, head][differ].unique().numel() != 1:
                return False
    return True


def compare(smol_fp32, niah_prompt, pair, share) -> dict:
    """Layer-heads kept identically (and how many), mean Jaccard overlap, each side's kept tokens per layer."""
    lm, engine = smol_fp32
    _, ex = niah_prompt
    ids, _ = ex.split(True)
    name, params, press, _ = pair
    n_keep = int(len(ids) * share)
    (ours, scores), theirs = native_masks(engine, ids, name, params, n_keep), press_masks(lm, ids, press, n_keep)
    assert all(m is not None for m in ours + theirs)
    return {
        "same": sum(int((a == b).all(-1).sum()) for a, b in zip(ours, theirs)),
        "total": sum(a.shape[0] * a.shape[1] for a in ours),
        "overlap": sum(((a & b).sum(-1) / (a | b).sum(-1)).mean().item() for a, b in zip(ours, theirs)) / len(ours),
        "ours": [int(a.sum()) for a in ours],
        "theirs": [int(b.sum()) for b in theirs],
        "ties_only": only_ties_differ(ours, theirs, scores),
    }


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[2] if isinstance(p[2], str) else p[2]['name']}")
def test_native_methods_keep_what_kvpress_keeps(smol_fp32, niah_prompt, pair, share):
    got = compare(smol_fp32, niah_prompt, pair, share)
    if pair[3] == "identical":
        assert got["same"] == got["total"], got
        return
    assert got["same"] < got["total"], got  # a difference to explain: not identical
    if pair[3] == "ties":
        assert got["ties_only"], got
        return
    # kvpress rounds a layer's count its own way (int(T · (1 − ratio)), pruned counts floored): ±2 tokens per head
    slack = 2 * got["total"] // len(got["ours"])
    apart = max(abs(a - b) for a, b in zip(got["ours"], got["theirs"]))
    assert abs(sum(got["ours"]) - sum(got["theirs"])) <= slack * len(got["ours"]), got  # the same budget ...
    assert apart > slack, got  # ... split over the layers otherwise


def test_decoding_generates_what_decoding_press_generates(smol_fp32, niah_prompt):
    """Decode-time compression, kvbench's `decoding` against kvpress's DecodingPress (Knorm, every 4 steps back to
    256 tokens; the answer takes 9 steps): the same compressions at the same steps keep the same tokens, so every
    step's logits agree to float rounding (< 0.01: the two caches are laid out and attended differently) where the
    uncompressed run's differ by more than 1 from the first compression on."""
    lm, engine = smol_fp32
    _, ex = niah_prompt
    prompt, suffix = ex.split(True)
    native = build_method("decoding", {"scorer": "knorm", "compress_every": 4, "decode_budget": 256})
    press = build_method(
        "kvpress",
        {"press": {"name": "DecodingPress", "base_press": "KnormPress", "compression_interval": 4, "target_size": 256}},
    )
    ours = engine.run(native, Budget.parse(1.0), prompt, suffix, max_new_tokens=20, keep_logits=True)
    theirs = engine.hooked_generate(press, None, prompt, suffix, 20, keep_logits=True)
    full = engine.run(build_method("full"), None, prompt, suffix, max_new_tokens=20, keep_logits=True)
    assert ours.decode_steps == theirs.decode_steps >= 8 and ours.kv_bytes == theirs.kv_bytes < full.kv_bytes
    assert ours.token_ids == theirs.token_ids
    apart = [(a - b).abs().max().item() for a, b in zip(ours.logits, theirs.logits)]  # per step
    from_full = [(a - b).abs().max().item() for a, b in zip(ours.logits, full.logits)]
    assert max(apart) < 1e-2 and max(from_full[5:]) > 1, (apart, from_full)


if __name__ == "__main__":  # the fidelity table (docs/methods.md)
    from omegaconf import OmegaConf

    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from kvbench.tasks import build_task
    from tests.conftest import CONF_DIR

    lm = load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"), "cpu", "float32")
    cfg = OmegaConf.load(CONF_DIR / "task" / "niah.yaml")
    cfg.update({"context_lengths": [512], "depths": [0.5]})
    task = build_task(cfg, lm.tokenizer, 0)
    fixture = ((lm, Engine(lm)), (task, task.examples()[0]))
    print("| kvbench | kvpress | budget | identical layer-heads | mean overlap | relation |\n|---|---|---|---|---|---|")
    for pair in PAIRS:
        for share in SHARES:
            got = compare(*fixture, pair, share)
            row = f"| {pair[0]} {pair[1] or ''} | {pair[2]} | {share} | {got['same']}/{got['total']} "
            print(row + f"| {got['overlap']:.3f} | {pair[3]} |")
