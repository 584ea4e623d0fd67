"""ChunkKV (methods/chunkkv.py): whole chunks in the order of their head-summed mean score (kvpress's
ChunkKVPress; tests/kvpress/test_chunkkv_fidelity.py checks the same chunks as the press on the bundled model)."""

import torch

from kvbench.methods import Budget, build_method
from kvbench.methods.chunkkv import chunk_keep
from tests.conftest import compressed


def test_whole_chunks_by_their_mean_score():
    # 3 heads, 23 positions, chunks of 5 (the last 3 long); chunk means over the head sum: 0, 4, 1, 3, 2 (the
    # partial last one)
    means = torch.tensor([0.0, 4.0, 1.0, 3.0, 2.0])
    summed = means.repeat_interleave(5)[:23] + torch.linspace(0, 0.01, 23)  # within-chunk order: later is higher
    scores = torch.stack([summed * 0.2, summed * 0.5, summed * 0.3])[None]  # (1, 3, 23): heads sum to `summed`
    kept = chunk_keep(scores, 5, 10)  # two whole chunks: 1 and 3
    assert kept.shape == (1, 3, 10) and bool((kept == kept[:, :1]).all())
    assert kept[0, 0].tolist() == list(range(5, 10)) + list(range(15, 20))
    kept = chunk_keep(scores, 5, 12)  # then the last chunk (mean 2, 3 positions) fills 2: its best two
    assert kept[0, 0].tolist() == list(range(5, 10)) + list(range(15, 20)) + [21, 22]


def test_on_the_model_every_head_keeps_whole_chunks(tiny_engine, prompt_ids):
    method = build_method("chunkkv", {"scorer": "snapkv", "chunk_size": 10})
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    n_keep = Budget.parse(0.25).tokens(len(prompt_ids))  # 135: 13 whole chunks + 5 positions of a 14th
    compression, _ = compressed(method, prefill.kv, prefill.stats, Budget.parse(0.25))
    for kept in compression.kept:
        assert kept.shape[-1] == n_keep and bool((kept == kept[:, :1]).all())
        chunks = torch.bincount(kept[0, 0] // 10, minlength=len(prompt_ids) // 10 + 1)
        assert int((chunks == 10).sum()) == n_keep // 10 and int(((chunks > 0) & (chunks < 10)).sum()) <= 1
        assert set(range(len(prompt_ids) - 32, len(prompt_ids))) <= set(kept[0, 0].tolist())  # snapkv's window


def test_chunks_of_one_are_the_scorer(tiny_engine, prompt_ids):
    """chunk_size=1 with one KV head's worth of scores is plain top-k: with knorm, the same positions as knorm
    wherever the heads agree; on a one-head sum, exactly knorm's choice of the summed scores."""
    scores = torch.randn(1, 1, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(chunk_keep(scores, 1, 20)[0, 0], scores[0, 0].topk(20).indices.sort().values)
