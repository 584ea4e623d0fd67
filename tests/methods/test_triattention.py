"""TriAttention (methods/triattention.py): the trigonometric series is the centre query's RoPE logit, the norm
term the authors' (E|q| − |E q|)·|k|, and the calibration kvbench computes and caches on the model in use."""

import pytest
import torch

from kvbench.methods import Budget, build_method
from kvbench.methods import triattention as tri
from kvbench.model.attention import StatsRequest
from kvbench.model.rope import rerotate
from tests.conftest import compressed


def rope(x: torch.Tensor, position: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(…, T, D) rotated to `position` (T,) by transformers' RoPE (rotate_half layout)."""
    return rerotate(x[None, None], position, inv_freq)[0, 0]


def test_the_series_is_the_centre_querys_logit_at_each_distance():
    """One offset o: S(k) = RoPE(E q, p + o) · RoPE(k, j) exactly; several: their mean (aggregation=mean)."""
    dim, n_keys, p = 32, 20, 100
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)  # (F,)
    gen = torch.Generator().manual_seed(0)
    q, keys = torch.randn(dim, generator=gen), torch.randn(n_keys, dim, generator=gen)  # pre-RoPE
    positions = torch.randint(0, p, (n_keys,), generator=gen)
    centre = tri.complex_pairs(q)  # (F,)
    for offsets in ([1.0], [1.0, 2.0, 4.0, 8.0]):
        got = tri.trig_scores(
            keys, positions, p, centre, centre.abs(), inv_freq, 1.0, torch.tensor(offsets), norm_term=False
        )
        rotated_keys = rope(keys, positions, inv_freq)  # (T, D)
        logits = [rope(q[None], torch.tensor([p + o]), inv_freq)[0] @ rotated_keys.T for o in offsets]
        assert torch.allclose(got, torch.stack(logits).mean(0), atol=1e-4)


def test_the_norm_term_is_the_centres_missing_length():
    dim = 16
    gen = torch.Generator().manual_seed(1)
    keys, q = torch.randn(5, dim, generator=gen), torch.randn(dim, generator=gen)
    centre, abs_centre = tri.complex_pairs(q), tri.complex_pairs(q).abs() + torch.rand(dim // 2, generator=gen)
    inv_freq = torch.rand(dim // 2, generator=gen)
    args = (keys, torch.arange(5), 9, centre, abs_centre, inv_freq, 1.0, torch.tensor([1.0]))
    extra = tri.trig_scores(*args) - tri.trig_scores(*args, norm_term=False)
    expected = ((abs_centre - centre.abs()) * tri.complex_pairs(keys).abs()).sum(-1)
    assert torch.allclose(extra, expected, atol=1e-5)


def test_calibration_is_the_mean_pre_rope_query(tiny, tiny_engine, prompt_ids):
    """E[q] from the calibration's own recording equals the query moments kvbench's statistics recorder keeps
    (expected_attention's, another code path) over the same prompt."""
    ids = prompt_ids[:300]
    centres = tri.calibrate(tiny, [ids])
    moments = tiny_engine.prefill(ids, StatsRequest(query_moments=frozenset({0}))).stats.moments[0]
    for layer, m in moments.items():
        mean, _ = m.mean_cov()  # (B, H_q, D)
        assert torch.allclose(centres.mean[layer], tri.complex_pairs(mean[0]), atol=1e-4)
        assert bool((centres.abs_mean[layer] >= centres.mean[layer].abs() - 1e-5).all())  # E|q| ≥ |E q|


def test_calibration_is_cached_per_model_and_knobs(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    method = build_method("triattention", {"calib_prompts": 2, "calib_tokens": 64})
    method.bind(tiny)
    (cached,) = (tmp_path / "triattention").iterdir()
    assert cached.name.startswith("tiny-random-2x64-")

    def fails(*args):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(tri, "calibrate", fails)
    again = build_method("triattention", {"calib_prompts": 2, "calib_tokens": 64})
    again.bind(tiny)  # from the file
    for layer in method.centres(None).mean:
        assert torch.equal(again.centres(None).mean[layer], method.centres(None).mean[layer])
    other = build_method("triattention", {"calib_prompts": 2, "calib_tokens": 32})
    with pytest.raises(AssertionError, match="calibrated again"):
        other.bind(tiny)  # other knobs: another calibration (and another config hash: they are params)
    assert other.params() != method.params()


def test_keeps_the_window_and_the_budget(tiny_engine, prompt_ids):
    method = build_method("triattention", {"window_size": 16})
    gen = tiny_engine.run(method, Budget.parse(0.25), prompt_ids, max_new_tokens=4)
    prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
    compression, _ = compressed(method, prefill.kv, prefill.stats, Budget.parse(0.25))
    n_keep = Budget.parse(0.25).tokens(len(prompt_ids))
    for kept in compression.kept:
        assert kept.shape[-1] == n_keep
        assert set(range(len(prompt_ids) - 16, len(prompt_ids))) <= set(kept[0, 0].tolist())
    assert gen.kv_ratio < 0.3
