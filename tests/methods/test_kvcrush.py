"""KVCrush (methods/kvcrush.py) on constructed scores: the importance part, the signatures, the anchor and the
uniformly spaced representatives, against a loop written out here."""

import torch

from kvbench.methods import Budget, build_method
from kvbench.methods.kvcrush import crush_keep, signatures
from tests.conftest import compressed


def reference(scores: torch.Tensor, n_keep: int, n_rep: int, anchor: list[int]) -> list[list[int]]:
    """Per head: top n_keep − n_rep positions, then n_rep of the others spaced along (Hamming distance, position)."""
    n_heads, n_tokens = scores.shape
    top_half = [set(scores[h].topk(n_tokens // 2).indices.tolist()) for h in range(n_heads)]
    bits = [[int(t in top_half[h]) for h in range(n_heads)] for t in range(n_tokens)]
    out = []
    for h in range(n_heads):
        important = set(scores[h].topk(n_keep - n_rep).indices.tolist())
        others = sorted(
            (t for t in range(n_tokens) if t not in important),
            key=lambda t: (sum(b != a for b, a in zip(bits[t], anchor)), t),
        )
        step = len(others) // n_rep
        out.append(sorted(important | {others[i * step] for i in range(n_rep)}))
    return out


def test_representatives_are_spaced_along_the_hamming_order():
    scores = torch.randn(1, 4, 40, generator=torch.Generator().manual_seed(0))
    for anchor, point in (("zeros", [0, 0, 0, 0]), ("ones", [1, 1, 1, 1]), ("alternate", [0, 1, 0, 1])):
        kept = crush_keep(scores, 12, 4, anchor)
        assert kept[0].tolist() == reference(scores[0], 12, 4, point), anchor


def test_signatures_are_each_heads_top_half():
    scores = torch.tensor([[[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]]])  # (1, 2, 4)
    assert signatures(scores)[0].tolist() == [[True, False], [True, False], [False, True], [False, True]]


def test_the_mean_anchor_is_the_candidates_majority():
    """anchor=mean: each bit is the majority over the tokens some head evicts (OpenVINO's MEAN, > 0.5)."""
    scores = torch.randn(1, 3, 30, generator=torch.Generator().manual_seed(4))
    n_keep, n_rep = 10, 3
    important = scores[0].topk(n_keep - n_rep).indices  # (3, 7)
    kept_everywhere = set.intersection(*(set(row.tolist()) for row in important))
    candidates = [t for t in range(30) if t not in kept_everywhere]
    bits = signatures(scores)[0]  # (30, 3)
    point = [int(bits[candidates, h].float().mean() > 0.5) for h in range(3)]
    assert crush_keep(scores, n_keep, n_rep, "mean")[0].tolist() == reference(scores[0], n_keep, n_rep, point)


def test_no_representatives_is_the_scorer(tiny_engine, prompt_ids):
    crush = build_method("kvcrush", {"representative_share": 0.0})
    snap = build_method("snapkv")
    prefill = tiny_engine.prefill(prompt_ids, crush.stats_request())
    crushed = compressed(crush, prefill.kv, prefill.stats, Budget.parse(0.25))[0]
    snapped = compressed(snap, prefill.kv, prefill.stats, Budget.parse(0.25))[0]
    for a, b in zip(crushed.kept, snapped.kept):
        assert torch.equal(a, b)


def test_the_scorers_window_is_kept(tiny_engine, prompt_ids):
    method = build_method("kvcrush", {"representative_share": 0.5})
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    compression, _ = compressed(method, prefill.kv, prefill.stats, Budget.parse(0.25))
    window = set(range(len(prompt_ids) - 32, len(prompt_ids)))
    for kept in compression.kept:
        for row in kept[0]:
            assert window <= set(row.tolist()) and len(set(row.tolist())) == kept.shape[-1]
