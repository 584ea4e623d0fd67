"""`python -m kvbench.plan [key=value ...]`: capacity and roofline from a model's config, no model run."""

from kvbench.plan.planner import _main

_main()
