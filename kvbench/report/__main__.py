"""`python -m kvbench.report STORE... [--out DIR]`: plots, report.html and report.md from stored rows."""

import sys

from kvbench.report.build import main

sys.exit(main())
