"""The results store: row files, claims for concurrent writers, aggregation and intervals (torch-free)."""
