"""`kvbench-lm-eval`: lm-eval's own command line with the `kvbench` model registered first.

lm-eval 0.4.x finds models only in its built-in table (lm_eval.models.MODEL_MAPPING) and reads no plugin entry
points, so `lm_eval --model kvbench` cannot see a third-party model; this script takes lm_eval's exact arguments:

    kvbench-lm-eval --model kvbench --model_args model=smollm2-135m,method=snapkv,budget=0.5 --tasks ...
"""

from __future__ import annotations

import sys

from kvbench import KvbenchError


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import kvbench.integrations.lm_eval_model  # noqa: F401  (registers "kvbench" with lm-eval)

    try:
        cli_evaluate()
    except KvbenchError as error:
        print(f"kvbench-lm-eval: error: {error}", file=sys.stderr)
        sys.exit(2)
