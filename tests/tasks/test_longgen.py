"""The long-generation recall task: examples, and its trace replayed through decode-time compression."""

from omegaconf import OmegaConf

from kvbench.methods import Budget, build_method
from kvbench.tasks import build_task
from tests.conftest import CONF_DIR


def _task(tiny, **overrides):
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "task" / "longgen.yaml"), overrides)
    return build_task(cfg, tiny.tokenizer, seed=0)


def test_examples_put_the_fact_first_and_the_trace_after_compression(tiny):
    examples = _task(tiny, trace_tokens=[64, 200], n_facts=2).examples()
    assert [e.meta["trace_tokens"] for e in examples] == [64, 64, 200, 200]
    short, long = examples[0], examples[2]
    assert short.answers == long.answers  # the same fact at every trace length
    assert short.answers[0] in tiny.tokenizer.decode(short.context_ids)
    assert len(long.question_ids) - len(short.question_ids) == 136  # exactly the trace lengths apart
    for query_aware in (True, False):  # the trace is never prefilled with the prompt
        assert long.split(query_aware) == (long.context_ids, long.question_ids)
    assert _task(tiny).score(f"is {short.answers[0]}.", short)["score"] == 1.0


def test_decoding_bounds_the_cache_over_the_trace(tiny, tiny_engine):
    example = _task(tiny, trace_tokens=[300], n_facts=1).examples()[0]
    method = build_method("decoding", {"scorer": "knorm", "compress_every": 50, "decode_budget": 100})
    prompt, appended = example.split(True)
    gen = tiny_engine.run(method, Budget.parse(1.0), prompt, appended, max_new_tokens=4)
    n_after = len(prompt) + len(appended) + gen.decode_steps
    steps_since = (n_after - len(prompt)) % 50  # tokens appended since the last compression
    assert gen.kv_bytes == 2 * 4 * 2 * 16 * 4 * (100 + steps_since)
    full = tiny_engine.run(build_method("full"), None, prompt, appended, max_new_tokens=4)
    assert full.kv_bytes == 2 * 4 * 2 * 16 * 4 * n_after
