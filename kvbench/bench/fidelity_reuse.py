"""On a CUDA GPU, in seconds: a grid's token-by-token rows (R-KV, H2O in the batch; KIVI, TurboQuant alone) keep their
decoding's distributions, which equal the teacher-forced pass's where a row followed the full answer (bit for bit, or
within TOLERANCE where cuBLAS runs a batch with other kernels than one row), and keeping them leaves each row's
measured peak memory unchanged. Tiny random model, per dtype of `bench.dtypes` (float32 and bfloat16; `dtype=X`: that
one).

    python -m kvbench.bench fidelity_reuse          # device=cuda; exit 1 on a mismatch

On an H200: every peak unchanged, rows decoded alone bit for bit, grid-batched fp32 rows within 1.8e-7 of a logit.
Without a CUDA device `device=cuda` is refused in one line; `device=cpu` runs the same checks on the CPU (its peaks
are the process's resident set, which other allocations move: a smoke check).
"""

from __future__ import annotations

from kvbench.bench.common import checked, header, load, options

TOLERANCE = 1e-5  # a logit: a batched kernel's rounding, far below any KL the columns report
OPTIONS = {"dtypes": ["float32", "bfloat16"]}


def configurations() -> list:
    from kvbench.methods import Budget, build_method, method_defaults

    def build(name, **params):
        return build_method(name, {**method_defaults(name), **params})

    return [
        (build("full"), None),
        (build("rkv"), Budget.parse(0.5)),
        (build("h2o"), Budget.parse(0.9)),
        (build("h2o"), Budget.parse(0.05)),
        (build("kivi", bits=8, group_size=16, residual_length=32), None),
        (build("turboquant", key_bits=4, value_bits=4), None),
    ]


def one_dtype(spec) -> int:
    """The checks at one dtype; how many failed."""
    from kvbench.model.attention import StatsRequest
    from kvbench.native import fidelity
    from kvbench.native.engine import Engine
    from kvbench.native.grid_decode import generate_grid

    lm = load(spec)
    engine, confs, bad = Engine(lm), configurations(), 0
    header("fidelity_reuse", lm)
    ids = lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"]
    prompt, question = ids[:-12], ids[-12:]
    request = StatsRequest()
    for method, _ in confs:
        request = request | method.stats_request()
    prefill = engine.prefill(prompt, request)
    runs = {
        keep: generate_grid(engine, prefill, confs, question, 16, max_padding=100.0, keep_logits=keep)
        for keep in (False, True)
    }
    answer = runs[True][0].token_ids
    for (method, budget), kept, plain in zip(confs[1:], runs[True][1:], runs[False][1:]):
        same_tokens = kept.token_ids == plain.token_ids
        peak = (kept.peak_mem_bytes, plain.peak_mem_bytes)
        decoded = fidelity.decoded_logits(kept, answer)
        if decoded is None:
            verdict = "left the answer: forced"
        else:
            forced = fidelity.compressed_logits(engine, prefill, method, budget, question, answer, 16)
            diff = (decoded - forced).abs().max().item()
            verdict = f"followed: max |decoded - forced| = {diff:g}"
            bad += diff > TOLERANCE
        bad += (not same_tokens) + (peak[0] != peak[1])
        name = f"{spec.dtype} {method.name} {budget}"
        print(f"{name:28s} kept {len(kept.logits):2d} steps  tokens same {same_tokens}  peak {peak}  {verdict}")
    return bad


def main(overrides: list[str]) -> int:
    opts, overrides = options(overrides, OPTIONS, "fidelity_reuse")
    defaults = ("model=tiny-random", "device=cuda", "method=full")
    if any(o.startswith("dtype=") for o in overrides):
        specs = [checked(overrides, *defaults)[0]]
    else:
        specs = [checked([*overrides, f"dtype={d}"], *defaults)[0] for d in opts["dtypes"]]
    bad = sum(one_dtype(spec) for spec in specs)
    print("ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0
