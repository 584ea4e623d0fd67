"""The capacity planner: bytes per token, fits and roofline per hardware preset, no model run."""
