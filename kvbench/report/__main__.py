"""`python -m kvbench.report STORE... [--out DIR]`: plots, report.html and report.md from stored rows.

Exit codes: 0 done (or --help); 2 bad input (one line, before any work: a flag, no rows, an unwritable --out).
"""

import sys

from kvbench.report.build import main

sys.exit(main())
