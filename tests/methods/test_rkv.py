"""R-KV (methods/rkv.py) against its code's formulas (Zefan-Cai/R-KV r1_kv.py, cal_similarity) on constructed
inputs, and its decode-time eviction."""

import torch
import torch.nn.functional as F

from kvbench.methods import Budget, build_method
from kvbench.methods.rkv import redundancy


def reference_redundancy(keys: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """R-KV's cal_similarity (retain_direction="last"), written out loop by loop: (H, T, D) → (H, T)."""
    out = []
    for k in keys:
        k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        sim = k @ k.T
        n = sim.shape[0]
        for i in range(n):
            sim[i, i] = 0.0
        for i in range(n):
            similar = [j for j in range(n) if sim[i, j] > threshold]
            sim[i, max(similar) if similar else 0] = 0.0  # the last similar key (0 when none, as the code does)
        out.append(sim.mean(-1).softmax(-1))
    return torch.stack(out)


def duplicated_keys(n_tokens=16, dim=64, copies=(2, 5, 9, 11)):
    keys = torch.randn(1, 1, n_tokens, dim, generator=torch.Generator().manual_seed(0))  # near-orthogonal
    keys[0, 0, list(copies)] = keys[0, 0, copies[0]] * torch.tensor([1.0, 2.0, 0.5, 3.0])[:, None]  # same direction
    return keys, list(copies)


def test_redundancy_is_the_codes():
    keys = torch.randn(1, 3, 40, 32, generator=torch.Generator().manual_seed(1))
    keys[0, :, 20:30] = keys[0, :, 5:15] + 0.1 * torch.randn(3, 10, 32)  # near duplicates
    assert torch.allclose(redundancy(keys)[0], reference_redundancy(keys[0]), atol=1e-6)


def test_the_redundant_duplicate_goes_first():
    """Equal attention everywhere: the score is the redundancy alone, so the copies of one key go first — all but
    one of them (each copy's similarity to its latest similar copy is not held against it)."""
    keys, copies = duplicated_keys()
    method = build_method("rkv", {"window_size": 2})
    votes = torch.full((1, 2, 16), 1 / 16)  # (B, H_q, T): 2 query heads on one KV head
    kept = method.window_keep(votes, keys, 15)[0, 0].tolist()  # one token dropped
    assert len(kept) == 15 and (set(range(16)) - set(kept)) <= set(copies)
    kept = method.window_keep(votes, keys, 13)[0, 0].tolist()  # three dropped: three of the four copies
    assert set(range(16)) - set(kept) <= set(copies) and len(set(copies) & set(kept)) == 1


def test_score_mixes_pooled_attention_and_redundancy():
    keys, _ = duplicated_keys()
    votes = torch.rand(1, 2, 16, generator=torch.Generator().manual_seed(2))
    method = build_method("rkv", {"window_size": 4, "kernel_size": 3, "mix_lambda": 0.3})
    importance = F.max_pool1d(votes.mean(1, keepdim=True)[..., :12], 3, stride=1, padding=1)  # (1, 1, 12)
    expected = 0.3 * importance - 0.7 * reference_redundancy(keys[0])[None, :, :12]
    assert torch.allclose(method.mixed_scores(votes, keys), expected, atol=1e-6)


def test_holds_the_budget_while_decoding(tiny_engine, prompt_ids):
    gen = tiny_engine.run(build_method("rkv"), Budget.parse(64), prompt_ids, max_new_tokens=10)
    assert gen.decode_steps == 9
    assert gen.kv_bytes == 2 * 4 * 2 * 16 * 64 * 4  # 64 tokens per layer at the end, not 64 + 9


def test_decode_rows_follow_the_kept_tokens(tiny_engine, prompt_ids):
    """The remembered decode rows are gathered with the cache: each is as long as the layer holds."""
    method = build_method("rkv", {"window_size": 4})
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    start = tiny_engine.compressed(prefill, method, Budget.parse(48), [])
    tiny_engine.decode(start, method, 12)
    for rows in start.hooks.rows.values():  # the example's remembered rows (methods/rkv.py's RKVCompression)
        assert 1 <= len(rows) <= 4 and all(r.shape[-1] == 48 for r in rows)
