"""`python -m kvbench.guide STORE...`: the selection guide (which method, at which budget, for this model).

Exit codes: 0 done (or --help); 2 bad input (one line, before any row is read).
"""

import sys

from kvbench.guide.selection import main

sys.exit(main())
