"""One run: configurations, work per example, the rows it writes, workloads."""
