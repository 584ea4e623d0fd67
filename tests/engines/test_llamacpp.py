"""engine=llamacpp on the bundled SmolLM2-135M: parity with kvbench's full cache, the cache bytes llama.cpp holds per
K/V type, eviction through llama_memory_seq_rm, and refusals. Needs .venv-llamacpp (`make engine-llamacpp`)."""

from __future__ import annotations

import os
import signal

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError, conf_dir
from kvbench.engines import ENGINES, EngineRequest
from kvbench.engines.llamacpp import ROOT, LlamaCpp

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        not (ROOT / LlamaCpp.venv / "bin" / "python").exists(),
        reason=f"{LlamaCpp.venv} is absent: run `make {LlamaCpp.make_target}`",
    ),
]

SMOL = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / "smollm2-135m.yaml"))
# SmolLM2-135M: 30 layers x (K + V) x 3 KV heads x 64 per token
VALUES_PER_TOKEN = 30 * 2 * 3 * 64


@pytest.fixture(scope="module")
def smol_fp32():
    from kvbench.model.load import load_model

    return load_model(OmegaConf.create(SMOL), "cpu", "float32")


@pytest.fixture(scope="module")
def prompts(smol_fp32):
    """Two short NIAH prompts (400 tokens, needle at 20 % and 80 %), built by kvbench's task code."""
    from kvbench.tasks.base import build_task

    cfg = OmegaConf.load(conf_dir() / "task" / "niah.yaml")
    cfg.context_lengths, cfg.depths, cfg.max_new_tokens = [400], [0.2, 0.8], 12
    return build_task(cfg, smol_fp32.tokenizer, 0, smol_fp32.max_context).examples()


@pytest.fixture(scope="module")
def engine():
    backend = ENGINES.get("llamacpp")(n_threads=1)
    backend.start(SMOL)
    yield backend
    backend.close()


def run(engine, example, option="full", budget=None, **knobs):
    ids = example.context_ids + example.question_ids
    return engine.generate(EngineRequest(ids, example.max_new_tokens, option, knobs, budget, stop_ids=[2]))


def test_full_matches_kvbench_full_cache(engine, prompts, smol_fp32):
    from kvbench.methods import METHODS
    from kvbench.model.attention import StatsRequest
    from kvbench.native.engine import Engine

    ours = Engine(smol_fp32)
    for example in prompts:
        ids = example.context_ids + example.question_ids
        expected = ours.generate(ours.prefill(ids, StatsRequest()), METHODS.get("full")(), None, [], 12).token_ids
        got = run(engine, example)
        assert got.token_ids == expected
        assert example.answers[0] in smol_fp32.tokenizer.decode(got.token_ids)
        assert got.engine_version.startswith("llama.cpp b")


def test_cache_bytes_per_type(engine, prompts):
    example = prompts[0]
    full, q8, q4 = (run(engine, example, option) for option in ("full", "q8_0", "q4_0"))
    tokens = example.n_tokens + full.decode_steps  # cells the sequence holds: prompt + fed decode tokens
    assert full.kv_bytes == full.kv_bytes_full == tokens * VALUES_PER_TOKEN * 2  # f16: 2 bytes a value
    assert q8.kv_bytes == tokens * VALUES_PER_TOKEN * 34 // 32  # q8_0: 34 bytes per 32 values
    assert q4.kv_bytes == tokens * VALUES_PER_TOKEN * 18 // 32  # q4_0: 18 bytes per 32 values
    assert q8.kv_bytes * 64 == full.kv_bytes * 34
    assert q8.kv_bytes_full == q4.kv_bytes_full == full.kv_bytes_full
    # the row's engine_extra names the engine's own knobs (llama.cpp's type_k/type_v), as the option ran
    assert q4.extra["knobs"] == {"type_k": "q4_0", "type_v": "q4_0", "flash_attn": "on"}


def test_seq_rm_drops_exactly_the_removed_tokens_and_a_removed_needle_is_lost(engine, prompts, smol_fp32):
    example = prompts[0]  # needle at 20 %: streamingllm's sinks + recent half do not hold it
    full = run(engine, example)
    evicted = run(engine, example, "streamingllm", budget=0.5, evict_during_decode=False)
    per_token = VALUES_PER_TOKEN * 2
    n_removed = evicted.extra["evicted_tokens"]
    assert n_removed == example.n_tokens - round(0.5 * example.n_tokens)
    assert full.kv_bytes == (example.n_tokens + full.decode_steps) * per_token
    assert evicted.kv_bytes == (example.n_tokens - n_removed + evicted.decode_steps) * per_token
    # the reference stays the uncompressed cache of the tokens fed (the two runs may stop at different lengths)
    assert evicted.kv_bytes_full == (example.n_tokens + evicted.decode_steps) * per_token
    assert example.answers[0] in smol_fp32.tokenizer.decode(full.token_ids)
    assert example.answers[0] not in smol_fp32.tokenizer.decode(evicted.token_ids)
    # the same budget, chosen by attention (snapkv pooled over layers and heads), keeps the needle
    snap = run(engine, example, "snapkv", budget=0.5)
    assert snap.extra["evicted_tokens"] == n_removed
    assert example.answers[0] in smol_fp32.tokenizer.decode(snap.token_ids)


def test_no_compression_equals_full_and_snapkv_evicts_by_attention(engine, prompts):
    example = prompts[1]
    full = run(engine, example)
    for option in ("streamingllm", "snapkv"):
        same = run(engine, example, option, budget=1.0)
        assert same.token_ids == full.token_ids
        assert same.kv_bytes == full.kv_bytes and same.extra["evicted_tokens"] == 0
    snap = run(engine, example, "snapkv", budget=0.5)
    kept = set(range(example.n_tokens)) - set(snap.extra["evicted_positions"])
    assert len(kept) == round(0.5 * example.n_tokens)
    assert set(range(example.n_tokens - 32, example.n_tokens)) <= kept  # the observation window stays
    assert snap.extra["flash_attn"] == "off"


def test_bad_options_refused_in_one_line_before_the_worker_starts(tmp_path):
    backend = LlamaCpp()
    assert backend.unavailable(SMOL, "q3_k") == (
        "engine=llamacpp has no option 'q3_k'; valid: full, q8_0, q4_0, k_q8_0, k_q8_0_v_q4_0, k_q4_0_v_q8_0, "
        "streamingllm, snapkv"
    )
    with pytest.raises(KvbenchError, match="type_v=q4_0 needs flash_attn=on"):
        backend.knobs("q4_0", {"flash_attn": "off"})
    with pytest.raises(
        KvbenchError, match=r"snapkv on llama\.cpp reads attention with flash attention off \(flash_attn=off\)"
    ):
        backend.knobs("snapkv", {"type_v": "q8_0", "flash_attn": "on"})
    assert "make engine-llamacpp" in LlamaCpp(root=tmp_path).unavailable(SMOL, "full")
    hub = {"name": "hub", "loader": "pretrained"}
    assert "runs GGUF models" in backend.unavailable(hub, "full")
    assert backend.worker is None  # nothing was started


def test_a_killed_worker_is_named_in_one_line():
    backend = LlamaCpp()
    backend.start(SMOL)
    try:
        os.kill(backend.worker.pid, signal.SIGKILL)
        with pytest.raises(KvbenchError) as died:
            backend.generate(EngineRequest([1, 2, 3], 2, "full"))
        assert "\n" not in str(died.value)
        assert str(died.value).startswith("the llamacpp worker died (exit code -9: killed by SIGKILL)")
    finally:
        backend.close()


PARENT = """
import sys, time
from omegaconf import OmegaConf
from kvbench import conf_dir
from kvbench.engines import EngineRequest
from kvbench.engines.llamacpp import LlamaCpp

backend = LlamaCpp(n_threads=1)
backend.start(OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / "smollm2-135m.yaml")))
print(backend.worker.pid, flush=True)
backend.generate(EngineRequest([1] * 64, 7000, "full", stop_ids=[]))  # a minute of decoding, killed midway
"""


def test_a_sigkilled_kvbench_takes_its_worker_with_it():
    """kvbench SIGKILLed while its worker decodes: the worker ends too, not re-parented to init (an idle worker
    would end anyway, at the end of its input)."""
    import subprocess
    import sys
    import time

    from tests.engines.test_protocol import wait_gone

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert parent.stdout is not None
    worker = int(parent.stdout.readline())
    time.sleep(1)  # the request is in the worker
    parent.kill()
    parent.wait()
    assert wait_gone(worker, within=10)


def test_prompt_cache_keeps_the_shared_prefix_and_answers_as_without(engine, prompts):
    """llama.cpp's prompt cache (reuse_prefix, as llama-server's cache_prompt): a prompt that starts with the previous
    request's tokens decodes only the rest, and answers token for token as a cold prompt; an evicting option, a
    prompt sharing nothing, or a request without the flag keep nothing."""
    first, second = prompts  # the same haystack, the needle elsewhere: they share the tokens before the first needle
    ids = [e.context_ids + e.question_ids for e in (first, second)]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    cold = run(engine, second)
    assert cold.extra["cached_tokens"] == 0
    run(engine, first)
    warm = engine.generate(EngineRequest(ids[1], second.max_new_tokens, "full", stop_ids=[2], reuse_prefix=True))
    assert warm.extra["cached_tokens"] == shared > 50
    assert warm.token_ids == cold.token_ids and warm.kv_bytes == cold.kv_bytes
    again = engine.generate(EngineRequest(ids[1], second.max_new_tokens, "full", stop_ids=[2], reuse_prefix=True))
    assert again.extra["cached_tokens"] == len(ids[1]) - 1 and again.token_ids == cold.token_ids  # all but the last
    evicting = engine.generate(
        EngineRequest(ids[1], second.max_new_tokens, "streamingllm", budget=0.5, stop_ids=[2], reuse_prefix=True)
    )
    assert evicting.extra["cached_tokens"] == 0
