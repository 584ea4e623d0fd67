"""KVzip against its definition: the max attention a prompt key receives from the queries of a reconstruction
prompt appended after it, read here from transformers' eager attention over prompt + reconstruction in one pass."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method
from kvbench.methods.kvzip import FIRST_PROMPT, template_parts
from kvbench.model.attention import StatsRecorder, StatsRequest
from tests.conftest import eager_attentions


def _reference(lm, ids: list[int], n_sink: int = 4) -> list[torch.Tensor]:
    """Per layer (1, H_kv, T): max over the reconstruction queries and the KV head's query group of eager softmax
    weights onto each prompt key (one chunk: the softmax runs over every key, as in the definition)."""
    tok = lm.tokenizer
    repeat = tok.encode(FIRST_PROMPT, add_special_tokens=False) + template_parts(tok)[1] + ids[n_sink:]
    attentions = eager_attentions(lm, ids + repeat)  # per layer (1, H_q, N, N)
    out = []
    for weights in attentions:
        onto_prompt = weights[:, :, len(ids) :, : len(ids)]  # (1, H_q, R, T)
        per_head = onto_prompt.amax(dim=2)  # (1, H_q, T)
        out.append(per_head.view(1, lm.n_kv_heads, -1, len(ids)).amax(dim=2))  # (1, H_kv, T)
    return out


def test_kvzip_scores_are_the_max_reconstruction_attention(tiny, tiny_engine, prompt_ids):
    ids = prompt_ids[:200]
    method = build_method("kvzip")
    prefill = tiny_engine.prefill(ids, method.stats_request())
    before = [(k.clone(), v.clone()) for k, v in prefill.kv]
    cache = method.compress(prefill.kv, prefill.stats, Budget.parse(60))
    reference = _reference(tiny, ids)
    for layer_idx, (layer, (keys, values)) in enumerate(zip(cache.layers, prefill.kv)):
        ours = method.scores(layer_idx, keys, values, prefill.stats)  # (1, H_kv, T)
        assert torch.isinf(ours[..., :4]).all()  # sinks always kept
        torch.testing.assert_close(ours[..., 4:], reference[layer_idx][..., 4:], rtol=1e-4, atol=1e-6)
        expected = ours.topk(60, dim=-1).indices.sort(-1).values  # (1, H_kv, 60)
        assert torch.equal(layer.keys, keys.gather(2, expected[..., None].expand(-1, -1, -1, keys.shape[-1])))
    for (k, v), (k0, v0) in zip(prefill.kv, before):  # the shared prefill is left as it was
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_kvzip_chunks_cover_every_position_once(tiny, tiny_engine, prompt_ids):
    """chunk_size ≥ the prompt is the one-pass definition; smaller chunks score every position once (finite, > 0)
    and change the scores only through the narrower softmax (a chunk's keys + sinks + itself)."""
    ids = prompt_ids[:200]
    whole, chunked = build_method("kvzip", {"chunk_size": 196}), build_method("kvzip", {"chunk_size": 64})
    prefill = tiny_engine.prefill(ids, StatsRequest())
    for method in (whole, chunked):
        reference = _reference(tiny, ids)
    for layer_idx, (keys, values) in enumerate(prefill.kv):
        one = whole.scores(layer_idx, keys, values, prefill.stats)[..., 4:]
        torch.testing.assert_close(one, reference[layer_idx][..., 4:], rtol=1e-4, atol=1e-6)
        parts = chunked.scores(layer_idx, keys, values, prefill.stats)[..., 4:]
        assert torch.isfinite(parts).all() and (parts > 0).all()
        assert not torch.allclose(parts, one)  # normalised over fewer keys: a different number, not a copy


def test_skip_template_repeats_what_follows_the_chat_templates_opening(tiny, tiny_engine):
    """skip_template (kvpress's KVzipPress): the template's opening is not repeated, its positions after the sinks
    score 0 (evicted first); what follows it is scored. tests/kvpress pins the selection to kvpress's own."""
    tok = tiny.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "a needle in a haystack " * 12}], tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    opening, _ = template_parts(tok)
    assert len(opening) > 4 and ids[: len(opening)] == opening  # the prompt opens with it
    prefill = tiny_engine.prefill(ids, StatsRequest())
    default, skipping = build_method("kvzip"), build_method("kvzip", {"skip_template": True})
    for layer_idx, (keys, values) in enumerate(prefill.kv):
        ours = skipping.scores(layer_idx, keys, values, prefill.stats)  # (1, H_kv, T)
        assert torch.isinf(ours[..., :4]).all() and (ours[..., 4 : len(opening)] == 0).all()
        assert (ours[..., len(opening) :] > 0).all()
        assert (default.scores(layer_idx, keys, values, prefill.stats)[..., 4 : len(opening)] > 0).all()


def test_kvzip_refuses_without_the_whole_prompt(tiny, tiny_engine, prompt_ids):
    method = build_method("kvzip")
    prefill = tiny_engine.prefill(prompt_ids[:100], StatsRequest())
    with pytest.raises(KvbenchError, match="re-reads the whole prompt"):
        method.scores(0, *prefill.kv[0], StatsRecorder(StatsRequest()))
    with pytest.raises(KvbenchError, match="chunk_size"):
        build_method("kvzip", {"chunk_size": 0})
    with pytest.raises(KvbenchError, match="scorer=kvzip cannot re-score while decoding"):
        build_method("decoding", {"scorer": "kvzip"})


def test_one_reconstruction_serves_every_budget_each_charged_its_cost(tiny_engine, prompt_ids, monkeypatch):
    """A grid's kvzip budgets (same knobs) share the prefill's reconstruction; each row is charged its seconds and
    peak as if alone, and keeps what a prefill of its own would have kept. Other knobs reconstruct again."""
    from kvbench.methods.kvzip import KVzip

    ids = prompt_ids[:200]
    calls = []
    real = KVzip.reconstruction_scores

    def counted(self, prompt):
        calls.append(self.chunk_size)
        return real(self, prompt)

    monkeypatch.setattr(KVzip, "reconstruction_scores", counted)
    prefill = tiny_engine.prefill(ids, StatsRequest())
    half, tenth = build_method("kvzip"), build_method("kvzip")
    a = tiny_engine.compressed(prefill, half, Budget.parse(0.5), [])
    b = tiny_engine.compressed(prefill, tenth, Budget.parse(0.1), [])
    assert calls == [2048]  # one reconstruction for both budgets
    derived = next(iter(prefill.stats.prompt.derived.values()))
    assert b.prefill_s >= derived.seconds and a.prefill_s >= derived.seconds  # the reuser pays it too
    assert b.prefill_peak >= derived.peak_bytes
    alone = tiny_engine.prefill(ids, StatsRequest())
    own = tiny_engine.compressed(alone, build_method("kvzip"), Budget.parse(0.1), [])
    for shared, single in zip(b.cache.layers, own.cache.layers):
        assert torch.equal(shared.keys, single.keys)
    tiny_engine.compressed(prefill, build_method("kvzip", {"chunk_size": 64}), Budget.parse(0.5), [])
    assert calls == [2048, 2048, 64]  # `alone` reconstructs its own; other knobs, their own


def test_charge_since_adds_what_was_reused_not_what_was_computed():
    from kvbench.model.attention import PromptSource

    prompt = PromptSource(None, [], [], peak=lambda: 7)
    mark = prompt.mark()
    prompt.derive("k", lambda: 1)
    assert prompt.charge_since(mark)[0] == 0.0  # the stretch that computed it already paid
    prompt.derive("k", lambda: 1)  # every layer asks: still one derivation, computed here
    assert prompt.charge_since(mark)[0] == 0.0
    mark = prompt.mark()
    assert prompt.derive("k", lambda: 2) == 1 and prompt.derive("k", lambda: 2) == 1  # reused, not recomputed
    seconds, peak = prompt.charge_since(mark)
    assert seconds == prompt.derived["k"].seconds and peak == 7  # charged once, however many layers asked
