"""The architecture matrix: every registered method on every family kvbench is tested on (tests/model/families.py).

For each family: the full cache reproduces transformers' own `generate`, token for token, and holds exactly what
transformers' own cache holds (sliding layers at their window, latent layers at their width). For each (family,
method): either the pair is refused before the model loads with one line naming what is unsupported
(kvbench.preflight.support), or budget 1.0 (or the method's lossless knobs) reproduces the full cache's tokens and
logits and, at budget 0.25, the bytes held are the method's own accounting (kvbench.model.kv_bytes).
"""

from __future__ import annotations

import pytest
import torch

from kvbench.methods import METHODS, Budget, build_method, method_defaults
from kvbench.methods.modes import HooksPrefill
from kvbench.model.kv_bytes import OPAQUE_TOLERANCE, KVShape, predict_kv_bytes
from kvbench.model.load import byte_tokenizer, finish
from kvbench.native.engine import Engine
from kvbench.preflight.support import refusal
from tests.model.families import FAMILIES, build

PROMPT, NEW = 150, 5  # a prompt longer than the families' 64-token window
METHOD_NAMES = [name for name in METHODS.names() if name != "full"]
# families' small head widths (16, 32) need KIVI groups that divide them
KNOBS = {"kivi": {"group_size": 16, "residual_length": 16}, "compose": {"overrides": {"kivi": {"group_size": 16}}}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    lm = finish(build(request.param), byte_tokenizer(), request.param, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, 300, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = Engine(lm)
    full = build_method("full")
    gen = engine.generate(engine.prefill(ids, full.stats_request()), full, None, [], NEW, keep_logits=True)
    return request.param, lm, engine, ids, gen


def generate(engine, ids, method, budget):
    if isinstance(method, HooksPrefill):  # kvpress's presses compress inside their own hooked prefill
        return engine.hooked_generate(method, budget, ids, [], NEW, keep_logits=True)
    own = engine.prepared(method)
    prefill = own.prefill(ids, method.stats_request())
    return own.generate(prefill, method, budget, [], NEW, keep_logits=True)


def test_full_cache_is_transformers_own(family):
    name, lm, _, ids, full = family
    hf = lm.model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, PROMPT:]
    assert full.token_ids == hf.tolist()
    assert full.kv_bytes == full.kv_bytes_full == lm.layout.full_bytes(PROMPT + full.decode_steps)
    if lm.layout.has_sliding:
        assert full.kv_bytes < full.kv_bytes_full_dense  # the window is a real saving of the model's own


def method_for(name: str, **extra):
    return build_method(name, {**method_defaults(name), **KNOBS.get(name, {}), **extra})


@pytest.mark.slow
@pytest.mark.parametrize("method_name", METHOD_NAMES)
def test_every_method_on_every_family(family, method_name):
    name, lm, engine, ids, full = family
    method = method_for(method_name)
    reason = refusal(method, lm.config)
    if reason is not None:
        assert ("\n" not in reason and method_name.split("-")[0] in reason) or "kivi" in reason
        pytest.skip(f"refused: {reason}")
    lossless = method.lossless_params(lm)
    if method.caps.has_budget or lossless is not None:
        exact = method_for(method_name, **(lossless or {}))
        same = generate(engine, ids, exact, Budget.parse(1.0) if exact.caps.has_budget else None)
        assert same.token_ids == full.token_ids
        assert all(torch.equal(a, b) for a, b in zip(same.logits, full.logits))
    if not method.caps.has_budget:
        return
    budget = Budget.parse(0.25)
    gen = generate(engine, ids, method := method_for(method_name), budget)
    if method_name == "kvpress":  # the planner does not model presses: the claim, on the model's own cache
        assert gen.kv_ratio == pytest.approx(method.kv_ratio_nominal(gen.context_tokens, gen.decode_steps))
        return
    predicted = predict_kv_bytes(method_for(method_name), budget, KVShape.of(lm), PROMPT, 0, gen.decode_steps)
    if predicted.exact:
        assert gen.kv_bytes <= predicted.kv_bytes if predicted.bound else gen.kv_bytes == predicted.kv_bytes
    else:
        assert gen.kv_bytes == pytest.approx(predicted.kv_bytes, rel=OPAQUE_TOLERANCE)
    assert gen.kv_ratio < 1.0 or not lm.layout.growing_share(PROMPT) > 0
