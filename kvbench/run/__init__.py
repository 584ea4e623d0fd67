"""One run, executed: the runner, the work per example (alone or in batches) and request workloads. Its checks before
it starts are kvbench.preflight; what a row is and what keys it, kvbench.rows."""
