"""`python -m kvbench.guide STORE...`: the selection guide (which method, at which budget, for this model)."""

import sys

from kvbench.guide.selection import main

sys.exit(main())
