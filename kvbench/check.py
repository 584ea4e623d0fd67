"""`python -m kvbench.check RESULTS --thresholds FILE`: the CI gate (kvbench/report/gate.py).

Exit codes: 0 every bound holds; 1 violations (each named); 2 bad input.
"""

import sys

from kvbench.report.gate import main

if __name__ == "__main__":
    sys.exit(main())
