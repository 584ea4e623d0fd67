"""On a CUDA GPU, in seconds: a grid's token-by-token rows (R-KV, H2O in the batch; KIVI, TurboQuant alone) keep their
decoding's distributions, which equal the teacher-forced pass's where a row followed the full answer (bit for bit, or
within TOLERANCE where cuBLAS runs a batch with other kernels than one row), and keeping them leaves each row's
measured peak memory (torch.cuda.max_memory_allocated) unchanged. Tiny random model, fp32 and bf16.
`python scripts/gpu/fidelity_reuse.py` (exit 1 on a mismatch). On an H200: every peak unchanged, rows decoded alone
bit for bit, grid-batched fp32 rows within 1.8e-7 of a logit."""

import sys

import torch
from omegaconf import OmegaConf

from kvbench.engine import fidelity
from kvbench.engine.engine import Engine
from kvbench.engine.grid_decode import generate_grid
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model

TOLERANCE = 1e-5  # a logit: a batched kernel's rounding, far below any KL the columns report


def build(name, **params):
    return build_method(name, {**method_defaults(name), **params})


def main() -> int:
    if not torch.cuda.is_available():
        print("scripts/gpu/fidelity_reuse.py: no CUDA GPU here: run it on one", file=sys.stderr)
        return 2
    bad = 0
    for dtype in ("float32", "bfloat16"):
        lm = load_model(OmegaConf.load("conf/model/tiny-random.yaml"), "cuda", dtype)
        engine = Engine(lm)
        ids = lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"]
        prompt, question = ids[:-12], ids[-12:]
        confs = [
            (build("full"), None),
            (build("rkv"), Budget.parse(0.5)),
            (build("h2o"), Budget.parse(0.9)),
            (build("h2o"), Budget.parse(0.05)),
            (build("kivi", bits=8, group_size=16, residual_length=32), None),
            (build("turboquant", key_bits=4, value_bits=4), None),
        ]
        request = StatsRequest()
        for method, _ in confs:
            request = request | method.stats_request()
        prefill = engine.prefill(prompt, request)
        runs = {}
        for keep in (False, True):
            runs[keep] = generate_grid(engine, prefill, confs, question, 16, max_padding=100.0, keep_logits=keep)
        answer = runs[True][0].token_ids
        for (method, budget), kept, plain in zip(confs[1:], runs[True][1:], runs[False][1:]):
            name = f"{dtype} {method.name} {budget}"
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
            print(f"{name:28s} kept {len(kept.logits):2d} steps  tokens same {same_tokens}  peak {peak}  {verdict}")
    print("ok" if not bad else f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
