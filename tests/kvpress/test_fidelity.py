"""Fidelity: kvbench's native methods against their kvpress presses on the bundled model (fp32, kvbench's NIAH
prompt), the same positions kept in every layer and KV head at matched settings — or the difference documented in
docs/methods.md "Method correctness". `python -m tests.kvpress.test_fidelity` prints the table.

Both sides see one prompt: the native method compresses kvbench's shared prefill; the press runs by its own hooks
(methods/kvpress.py) on a fresh prefill. Kept positions are found by each held key's fingerprint (a gather copies a
key's bytes), and for head-wise presses from kvpress's masked indices. Budgets are token counts, as kvpress rounds
down (int(T · (1 − ratio))) where kvbench rounds.
"""

from __future__ import annotations

import pytest

from tests.kvpress.conftest import NO_KVPRESS

pytest.importorskip("kvpress", reason=NO_KVPRESS)
import torch
from transformers import DynamicCache

from kvbench.methods import Budget, build_method
from kvbench.methods.kvpress import fingerprint, kept_mask_of
from kvbench.model.ragged import RaggedLayer

pytestmark = pytest.mark.real_model

# (native method, its params, the press, how the selections relate at these settings):
#   "identical"     every layer and KV head keeps the same positions
#   "layer_counts"  the same total, other per-layer counts (the documented difference), hence other positions
#   "positions"     the same count in every layer, other positions in some heads (documented or listed as open)
PAIRS = [
    ("knorm", {}, "KnormPress", "identical"),
    ("keydiff", {}, "KeyDiffPress", "identical"),
    ("snapkv", {"window_size": 32}, {"name": "SnapKVPress", "window_size": 32}, "identical"),
    ("streamingllm", {"start_size": 4}, {"name": "StreamingLLMPress", "n_sink": 4}, "identical"),
    ("tova", {}, "TOVAPress", "identical"),
    ("expected_attention", {}, "ExpectedAttentionPress", "identical"),
    (
        "adakv",
        {"scorer": "snapkv"},
        {"name": "AdaKVPress", "press": {"name": "SnapKVPress", "window_size": 32}},
        "identical",
    ),
    # one KV head of 90 differs at both budgets: not yet explained (docs/methods.md lists it open)
    ("adakv", {"scorer": "knorm"}, {"name": "AdaKVPress", "press": "KnormPress"}, "positions"),
    # kvpress builds its pyramid on (budget + window) and counts the window inside each layer's count;
    # KVCache-Factory (and kvbench) on the budget, the window on top: other per-layer counts, same total
    ("pyramidkv", {"window_size": 32}, {"name": "PyramidKVPress", "window_size": 32}, "layer_counts"),
    # kvpress's default ranks every layer's scores together (layerwise=False); kvbench keeps n per KV head
    ("kvzip", {}, "KVzipPress", "layer_counts"),
    # layerwise=True shares one budget per layer like adakv alpha_safeguard=0, but the positions differ: kvpress
    # repeats only what follows the chat template's prefix (its positions n_sink..prefix score 0), kvbench all
    # after n_sink — the likely cause, not yet isolated
    ("adakv", {"scorer": "kvzip", "alpha_safeguard": 0.0}, {"name": "KVzipPress", "layerwise": True}, "positions"),
]
SHARES = (0.25, 0.5)


def native_masks(engine, ids, name, params, n_keep) -> list[torch.Tensor]:
    """Per layer (1, H_kv, T) bool: the positions the native method's compressed cache holds."""
    method = build_method(name, params)
    prefill = engine.prefill(list(ids), method.stats_request())
    cache = engine.compressed(prefill, method, Budget(n_keep), []).cache
    masks = []
    for (keys, _), layer in zip(prefill.kv, cache.layers):
        before = fingerprint(keys)  # (1, H_kv, T)
        if isinstance(layer, RaggedLayer):  # head-wise: each head's run of the flat keys on its own
            heads = layer.flat_keys.split(layer.lengths)  # per (b, h): (T_bh, D)
            rows = [kept_mask_of(before[:, h : h + 1], k[None, None]) for h, k in enumerate(heads)]
            masks.append(torch.cat(rows, dim=1))
        else:
            masks.append(kept_mask_of(before, layer.keys))
    return masks


def press_masks(lm, ids, press, n_keep) -> list[torch.Tensor]:
    method = build_method("kvpress", {"press": press})
    with method.hooked_prefill(lm, len(ids), Budget(n_keep)):
        lm.forward(list(ids), list(range(len(ids))), DynamicCache())
    with method.hooked_decode(lm):  # takes kvpress's masks off the model again
        pass
    return method.kept_masks


def compare(smol_fp32, niah_prompt, pair, share) -> dict:
    """Layer-heads kept identically (and how many), mean Jaccard overlap, each side's kept tokens per layer."""
    lm, engine = smol_fp32
    _, ex = niah_prompt
    ids, _ = ex.split(True)
    name, params, press, _ = pair
    n_keep = int(len(ids) * share)
    ours, theirs = native_masks(engine, ids, name, params, n_keep), press_masks(lm, ids, press, n_keep)
    assert all(m is not None for m in ours + theirs)
    return {
        "same": sum(int((a == b).all(-1).sum()) for a, b in zip(ours, theirs)),
        "total": sum(a.shape[0] * a.shape[1] for a in ours),
        "overlap": sum(((a & b).sum(-1) / (a | b).sum(-1)).mean().item() for a, b in zip(ours, theirs)) / len(ours),
        "ours": [int(a.sum()) for a in ours],
        "theirs": [int(b.sum()) for b in theirs],
    }


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[2] if isinstance(p[2], str) else p[2]['name']}")
def test_native_methods_keep_what_kvpress_keeps(smol_fp32, niah_prompt, pair, share):
    got = compare(smol_fp32, niah_prompt, pair, share)
    if pair[3] == "identical":
        assert got["same"] == got["total"], got
        return
    # kvpress rounds a layer's count its own way (int(T · (1 − ratio)), pruned counts floored): ±2 tokens per head
    slack = 2 * got["total"] // len(got["ours"])
    apart = max(abs(a - b) for a, b in zip(got["ours"], got["theirs"]))
    assert abs(sum(got["ours"]) - sum(got["theirs"])) <= slack * len(got["ours"]), got  # the same budget
    assert got["same"] < got["total"], got
    if pair[3] == "layer_counts":  # ... split over the layers otherwise
        assert apart > slack, got
    else:  # ... split alike, other positions
        assert apart <= slack, got


if __name__ == "__main__":  # the fidelity table (docs/methods.md)
    from omegaconf import OmegaConf

    from kvbench.engine.engine import Engine
    from kvbench.model.load import load_model
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
