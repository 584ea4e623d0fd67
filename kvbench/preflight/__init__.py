"""The checks before a run, every one before the model loads: a bad value is one `KvbenchError` line naming the fix
(exit 2), never a traceback mid-run.

entrance.py      the whole configuration: top-level keys, method knobs, grid entries, task knobs, the engine
                 (`check_config`, `check_run`), then each method against the model's config (`check_model_support`)
support.py       which methods run on which model families, from the model's config
model_fields.py  a model's shape as written (config.json, a conf/model `architecture:` block), field by field

The run-mode table the entrance checks (which modes combine) is kvbench/rows/modes.py: a mode is part of a row's
identity. (`python -m kvbench.check` is the CI gate over stored rows, kvbench/check.py; kvbench.config holds the rules
these checks apply.)"""
