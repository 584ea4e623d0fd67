"""Diagnostics and the selection guide: where evicted evidence was, verdicts, which method to pick."""
