"""Expected Attention pinned to its formula computed by hand (scalars, no matrices), and its query statistics on the
bundled model equal to what kvpress computes from q_proj (the part a bf16 model can break: RoPE un-rotation)."""

import math
from types import SimpleNamespace

import pytest
import torch

from kvbench.methods import build_method
from kvbench.model.attention import QueryMoments

THETA, N_FUTURE = 0.3, 3
QUERIES = [(1.0, 0.0), (0.0, 2.0), (-0.5, 1.0)]  # pre-RoPE queries of one head, head_dim 2
KEYS = [(9.0, 9.0), (0.5, -1.0), (2.0, 0.3), (-1.0, 1.5), (0.2, 0.2), (1.5, 1.0)]  # post-RoPE keys, position 0 = sink
VALUE_NORMS = [1.0, 2.0, 0.5, 1.0, 3.0, 1.5]


def _hand_scores(use_covariance: bool, use_vnorm: bool, epsilon: float) -> list[float]:
    """kvpress's ExpectedAttentionPress on a 2-d head, written with scalars: mean μ and population covariance Σ of
    the queries; R̄ = mean over p ∈ [T, T+F) of [[cos pθ, −sin pθ], [sin pθ, cos pθ]] (RoPE on a 2-d head);
    exponent μ'·k/√d + kᵀΣ'k/(2d) with μ' = R̄μ, Σ' = R̄ΣR̄ᵀ; softmax over the non-sink keys; (· + ε)·‖v‖."""
    n = len(QUERIES)
    m1, m2 = sum(q[0] for q in QUERIES) / n, sum(q[1] for q in QUERIES) / n
    s11 = sum(q[0] * q[0] for q in QUERIES) / n - m1 * m1
    s12 = sum(q[0] * q[1] for q in QUERIES) / n - m1 * m2
    s22 = sum(q[1] * q[1] for q in QUERIES) / n - m2 * m2
    first = len(KEYS)  # the future starts after the prompt's last position
    c = sum(math.cos(p * THETA) for p in range(first, first + N_FUTURE)) / N_FUTURE
    s = sum(math.sin(p * THETA) for p in range(first, first + N_FUTURE)) / N_FUTURE
    r = [[c, -s], [s, c]]
    mu = [r[0][0] * m1 + r[0][1] * m2, r[1][0] * m1 + r[1][1] * m2]
    sigma = [[s11, s12], [s12, s22]]
    rs = [[sum(r[i][k] * sigma[k][j] for k in range(2)) for j in range(2)] for i in range(2)]  # R̄Σ
    cov = [[sum(rs[i][k] * r[j][k] for k in range(2)) for j in range(2)] for i in range(2)]  # R̄ΣR̄ᵀ
    exponents = []
    for k1, k2 in KEYS[1:]:
        e = (mu[0] * k1 + mu[1] * k2) / math.sqrt(2)
        if use_covariance:
            e += (k1 * (cov[0][0] * k1 + cov[0][1] * k2) + k2 * (cov[1][0] * k1 + cov[1][1] * k2)) / 2 / 2
        exponents.append(e)
    total = sum(math.exp(e) for e in exponents)
    probs = [math.exp(e) / total for e in exponents]
    if use_vnorm:
        probs = [(p + epsilon) * v for p, v in zip(probs, VALUE_NORMS[1:])]
    return probs


@pytest.mark.parametrize(
    "use_covariance, use_vnorm, epsilon",
    [(True, True, 0.0), (False, True, 0.0), (True, False, 0.0), (True, True, 0.01)],
)
def test_expected_attention_equals_the_formula_by_hand(use_covariance, use_vnorm, epsilon):
    queries = torch.tensor(QUERIES)[None, None]  # (B=1, H_q=1, N, D=2)
    moments = QueryMoments.empty(1, 1, 2, torch.tensor([THETA]), 1.0)
    moments.add(queries)
    stats = SimpleNamespace(moments={1: {0: moments}})
    keys = torch.tensor(KEYS)[None, None]  # (1, H_kv=1, T, 2)
    values = torch.tensor(VALUE_NORMS)[None, None, :, None] * torch.tensor([0.6, 0.8])  # (1, 1, T, 2): ‖v‖ as listed
    knobs = dict(use_covariance=use_covariance, use_vnorm=use_vnorm, epsilon=epsilon)
    method = build_method("expected_attention", dict(n_sink=1, n_future_positions=N_FUTURE, **knobs))
    scores = method.scores(0, keys, values, stats)  # (1, 1, T)
    assert scores[0, 0, 0] == float("inf")  # the sink is always kept (its huge key would otherwise win)
    torch.testing.assert_close(scores[0, 0, 1:], torch.tensor(_hand_scores(use_covariance, use_vnorm, epsilon)))


def test_the_rotation_is_the_average_of_ropes_rotations():
    """R̄ applied to x equals the mean of transformers' RoPE (x·cos + rotate_half(x)·sin) over the future positions."""
    from kvbench.model.rope import rotate_half

    inv_freq = torch.tensor([1.0, 0.1, 0.01, 0.001])  # (D/2,)
    x = torch.randn(8)
    method = build_method("expected_attention", dict(n_future_positions=7))
    rotation = method.average_rotation(100, inv_freq, 1.0)  # (D, D)
    angles = torch.arange(100, 107).float()[:, None] * torch.cat([inv_freq, inv_freq])  # (F, D)
    roped = x * angles.cos() + rotate_half(x[None].expand(7, -1)) * angles.sin()  # (F, D)
    torch.testing.assert_close(rotation @ x, roped.mean(0))


@pytest.mark.real_model
def test_query_moments_equal_q_proj_moments_on_the_bundled_model():
    """The recorder rebuilds pre-RoPE queries from the model's post-RoPE ones (bf16 or fp32: dtype=auto); kvpress
    projects the hidden states with q_proj. Both must give the same mean and covariance at positions up to 1K."""
    from omegaconf import OmegaConf

    from kvbench.model.attention import StatsRequest
    from kvbench.model.load import load_model
    from kvbench.native.engine import Engine
    from tests.conftest import CONF_DIR

    lm = load_model(OmegaConf.load(CONF_DIR / "model" / "smollm2-135m.yaml"), "cpu", "auto")
    layers = lm.model.model.layers
    hidden = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: hidden.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True
        )
        for i, layer in enumerate(layers)
    ]
    try:
        ids = lm.tokenizer("The grass is green. The sky is blue. Here we go. " * 80)["input_ids"][:1000]
        stats = Engine(lm).prefill(ids, StatsRequest(query_moments=frozenset({4}))).stats
    finally:
        for hook in hooks:
            hook.remove()
    for layer_idx in (0, 15, 29):
        attn = layers[layer_idx].self_attn
        h = hidden[layer_idx][:, 4:]  # (1, N, hidden)
        q = attn.q_proj(h).float().view(1, h.shape[1], -1, attn.head_dim).transpose(1, 2)  # (1, H_q, N, D)
        mean = q.mean(2)  # (1, H_q, D)
        centered = q - mean[:, :, None]  # (1, H_q, N, D)
        cov = torch.einsum("bhni,bhnj->bhij", centered, centered) / h.shape[1]  # (1, H_q, D, D)
        ours_mean, ours_cov = stats.moments[4][layer_idx].mean_cov()
        assert (ours_mean - mean).norm() / mean.norm() < 2e-3
        assert (ours_cov - cov).norm() / cov.norm() < 1e-2
