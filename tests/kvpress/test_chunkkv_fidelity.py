"""Fidelity: kvbench's `chunkkv` against kvpress's ChunkKVPress on the bundled model (fp32, kvbench's NIAH prompt),
the same positions kept in every layer and KV head.

kvpress keeps int(n_chunks · (1 − ratio)) whole chunks; kvbench keeps exactly the budget (whole chunks, the next
one partly). On a prompt cut to a multiple of the chunk size, with the ratio that makes kvpress keep m chunks and a
kvbench budget of m · chunk_size tokens, both keep m whole chunks: the test checks they are the same chunks.
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
from tests.kvpress.test_fidelity import native_masks

pytestmark = pytest.mark.real_model

CHUNK = 16
PAIRS = [  # (chunkkv's scorer and its knobs, the press ChunkKVPress wraps)
    # layer 0 differs (96 positions at 25 %): not yet explained; suspected ties among the chunk means of layer 0's
    # repeated-token key norms (tests/kvpress/test_fidelity.py's AdaKV-over-Knorm ties), ranked by topk vs argsort
    pytest.param(({"scorer": "knorm"}, "KnormPress"), marks=pytest.mark.xfail(reason="layer 0 differs: unexplained")),
    ({"scorer": "snapkv", "scorer_params": {"window_size": 32}}, {"name": "SnapKVPress", "window_size": 32}),
]


def chunk_press_masks(lm, ids, inner, n_chunks_kept: int) -> list[torch.Tensor]:
    """Per layer (1, H_kv, T) bool: what ChunkKVPress(inner, chunk_length=CHUNK) keeps, given the ratio with
    int(n_chunks · (1 − ratio)) = n_chunks_kept."""
    n_chunks = len(ids) // CHUNK
    ratio = 1 - (n_chunks_kept + 0.5) / n_chunks
    method = build_method("kvpress", {"press": {"name": "ChunkKVPress", "press": inner, "chunk_length": CHUNK}})
    fixed = mock.patch.object(kvpress_adapter, "compression_ratio", lambda budget, n_prompt: ratio)
    with fixed, method.hooked_prefill(lm, len(ids), Budget(n_chunks_kept * CHUNK)):
        lm.forward(list(ids), list(range(len(ids))), DynamicCache())
    with method.hooked_decode(lm):
        pass
    return method.kept_masks


@pytest.mark.parametrize("share", (0.25, 0.5))
@pytest.mark.parametrize("pair", PAIRS, ids=["knorm", "snapkv"])
def test_chunkkv_keeps_the_chunks_chunkkv_press_keeps(smol_fp32, niah_prompt, pair, share):
    lm, engine = smol_fp32
    _, ex = niah_prompt
    ids, _ = ex.split(True)
    ids = list(ids)[: len(ids) // CHUNK * CHUNK]  # whole chunks only: kvpress then keeps m · CHUNK tokens
    params, inner = pair
    n_chunks_kept = round(len(ids) // CHUNK * share)
    ours, _ = native_masks(engine, ids, "chunkkv", {**params, "chunk_size": CHUNK}, n_chunks_kept * CHUNK)
    theirs = chunk_press_masks(lm, ids, inner, n_chunks_kept)
    for layer, (a, b) in enumerate(zip(ours, theirs)):
        assert a.sum() == b.sum() == n_chunks_kept * CHUNK * a.shape[1], layer
        assert torch.equal(a, b), f"layer {layer}: {(a != b).sum()} positions differ"
        chunks = a[0, 0].view(-1, CHUNK)  # (C, CHUNK): whole chunks, the same in every head
        assert bool((chunks.all(-1) | ~chunks.any(-1)).all()) and bool((a == a[:, :1]).all())
