"""Benchmarks of kvbench itself, over the validated configuration: `python -m kvbench.bench NAME [overrides]`.

Each prints ratios measured in one run on this machine (named with its CPU or GPU), never asserted in a test. The
overrides are `python -m kvbench`'s (model=, dtype=, task.context_lengths=, grid.method=...), checked as a run checks
them, and the benchmark's own `bench.KEY=VALUE` options (its module docstring lists them): a bad one is one line and
exit 2. `python -m kvbench.bench all` (`make bench`) runs the ones in ALL; docs/benchmarks.md has each figure's command.

The harness's own cost:
- sweep: a grid's price. Plain transformers (prefill + greedy loop, its own DynamicCache) vs `method=full` vs the
  default sweep (full + five methods × two budgets, fidelity on), on the same prompts; the outputs compared; each
  part's share (fidelity, the grid's decode) from the rows.
- decode: a grid decode step of B rows against one row's, and each one's share of the bandwidth bound.
- stats: the attention statistics' cost (H2O's and TOVA's column sums, SnapKV's window) over the plain prefill.
- engine: prefill tokens/s and decode ms/token of the full cache per dtype (bf16 / fp32 ratios).
- shared_prefill: separate runs vs one shared prefill vs shared prefill + grid decoding, outputs compared.
- vs_generate: kvbench's full-cache example against transformers' `generate` on the same prompt.
Methods, kernels and memory:
- decode_methods: decode ms/token of bounded caches (StreamingLLM, H2O, KIVI paths) against the full cache.
- h2o_prefill: H2O's statistics over the plain prefill, C kernel and torch loop.
- cpu_kernels: each C kernel's end-to-end share, every kernel on but one.
- kvzip: KVzip's reconstruction cost, model-dtype vs fp32 products, KVzipPress, shared across a grid.
- peak_memory: peak memory per method and prefill mode (shared, inline, chunked; task=ppl streamed).
- throughput: the largest batch within a memory limit and its tokens/s, against the planner's prediction.
- prefix: prefix caching's time to first token and bytes held, with vs without.
- h2o_mass: where H2O's accumulated attention mass goes on NIAH, and which needle tokens each selection keeps.
- stability: whether a method keeps the same tokens in bf16 as in fp32 (kept-set overlap, tied scores at the cut).
On a GPU (refused in one line without one):
- gpu: latency and memory per method on a real architecture with random weights (default Llama-3.1-8B's).
- kernels: the Triton kernels against their torch versions (no model).
- fidelity_reuse: kept decoding distributions equal the teacher-forced ones, peaks unchanged (tiny model).
Against another implementation:
- engine_parity, engine_options: a serving engine (engine=NAME, its venv built) against kvbench's full cache, and
  its options.
- lm_eval_vs_hf: kvbench's lm-eval model against lm-eval's `hf` model on the fixture tasks.
Tools over stored rows (no model; `bench.` options only):
- compare_reuse: compress once vs per question, paired per request.
- diagnose_evidence: which evidence tokens each layer × KV head kept, from a diagnose=true run.
- leaderboard_vs_kvpress: our leaderboard's method pairs against kvpress's published order.
- methods2026: docs/methods.md's tables of the 2026 methods from a store.
"""

from __future__ import annotations

BENCHMARKS = {
    name: f"kvbench.bench.{name}"
    for name in (
        "sweep",
        "decode",
        "stats",
        "engine",
        "shared_prefill",
        "vs_generate",
        "decode_methods",
        "h2o_prefill",
        "cpu_kernels",
        "kvzip",
        "peak_memory",
        "throughput",
        "prefix",
        "h2o_mass",
        "stability",
        "gpu",
        "kernels",
        "fidelity_reuse",
        "engine_parity",
        "engine_options",
        "lm_eval_vs_hf",
        "compare_reuse",
        "diagnose_evidence",
        "leaderboard_vs_kvpress",
        "methods2026",
    )
}
ALL = ("sweep", "decode", "stats", "engine")  # `all`: the harness's own cost on the default model, CPU or GPU
