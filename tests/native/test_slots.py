"""Decode-time eviction in place for a configuration decoded alone (kvbench/native/slots.py): the same tokens, logits and
kv_bytes as evicting by gather into new tensors, with the cache's layers in slot buffers while decoding."""

import pytest
import torch

from kvbench.methods import Budget, build_method, method_defaults
from kvbench.native import slots

CONFIGS = [
    ("h2o", {}, 0.3),
    ("h2o", {"evict_every": 4}, 0.3),
    ("streamingllm", {}, 0.25),
    ("tova", {}, 0.4),
    ("decoding", {"compress_every": 2, "decode_budget": 100}, 0.6),
    ("snapkv", {"window_size": 8}, 0.5),  # acts on no decode step: left as plain layers
]


@pytest.mark.parametrize(("name", "knobs", "budget"), CONFIGS, ids=lambda c: str(c))
def test_in_place_equals_gather(tiny_engine, prompt_ids, name, knobs, budget, monkeypatch):
    if not slots.decode_kernels(tiny_engine.lm.model):
        pytest.skip("no C compiler: the decode kernels are not built")
    used = []
    use_slots = slots.use_slots
    monkeypatch.setattr("kvbench.native.engine.use_slots", lambda *a: used.append(use_slots(*a)) or used[-1])

    def run():
        method = build_method(name, {**method_defaults(name), **knobs})
        prefill = tiny_engine.prefill(prompt_ids, method.stats_request())
        return tiny_engine.generate(prefill, method, Budget.parse(budget), [], max_new_tokens=12, keep_logits=True)

    in_place = run()
    assert used == [name != "snapkv"]
    monkeypatch.setattr("kvbench.native.engine.use_slots", lambda *a: False)  # evict by gather into new tensors
    gathered = run()
    assert in_place.token_ids == gathered.token_ids and in_place.decode_steps == gathered.decode_steps == 11
    assert all(torch.equal(a, b) for a, b in zip(in_place.logits, gathered.logits))
    assert in_place.kv_bytes == gathered.kv_bytes


def test_slot_layer_appends_evicts_and_grows():
    keys, values = (torch.randn(1, 2, 5, 4) for _ in range(2))  # (1, H_kv, T, D)
    layer = slots.SlotLayer(keys, values, spare=1)
    new_k, new_v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    out_k, _ = layer.update(new_k, new_v)
    assert torch.equal(out_k, torch.cat([keys, new_k], 2)) and layer._keys.shape[2] == 6  # into the spare slot
    index = torch.tensor([[[0, 2, 3, 4, 5], [1, 2, 3, 4, 5]]])
    want = torch.cat([keys, new_k], 2).gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 4))
    layer.select(index)
    assert torch.equal(layer.keys, want) and layer.get_seq_length() == 5
    more = torch.randn(1, 2, 3, 4)
    layer.update(more, more)  # no room for 3: a new buffer
    assert torch.equal(layer.keys, torch.cat([want, more], 2)) and layer._keys.shape[2] == 9
