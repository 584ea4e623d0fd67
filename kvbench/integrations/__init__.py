"""Other tools: the Ray launcher and kvbench as an lm-evaluation-harness model."""
