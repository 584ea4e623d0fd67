"""`python -m kvbench.plan [key=value ...]`: capacity and roofline from a model's config, no model run.

Exit codes: 0 done; 1 Hydra's own errors (an unknown model= or hardware=: Hydra lists the options); 2 bad input
(one line naming the fix).
"""

from kvbench.plan.planner import _main

_main()
