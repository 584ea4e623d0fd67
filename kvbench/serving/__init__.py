"""Serving a request trace under a fixed KV memory budget with kvbench's own engine (issue 35).

trace.py      the requests: prompts from a task or drawn lengths, output lengths, arrivals (burst or Poisson)
inputs.py     the `serving:` block checked before the model loads (`check`), and once the trace is built
batch.py      the running requests' caches as rows of one batch (rows join and leave between steps)
scheduler.py  continuous batching: admit while the budget holds, compress at admission, decode together, preempt
metrics.py    per-request and per-run figures (TTFT, TPOT, percentiles, goodput under an SLO)
predict.py    the capacity planner's concurrency and tokens/s for the same model, budget and method
run.py        one trace × every configuration × every KV budget → rows; `python -m kvbench.serving`
              (`python -m kvbench +experiment=serving` routes here)
engines.py    the same trace through serving engines' continuous batching (kvbench.engines: ServingEngine.serve)
prefix.py     prefix caching side by side: kvbench vs the engines' (`python -m kvbench.serving.prefix`)
"""

from kvbench import KvbenchError


class OutputFailed(KvbenchError):
    """Writing the run's outputs failed mid-run (disk full, ...): the run stops; it is no engine's failure."""

    exit_code = 3
