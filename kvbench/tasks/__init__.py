"""Tasks: each builds token-level examples from a config and scores predictions with a pure metric function.

Every module and subpackage here is imported on first use (importing a task's module registers it with
`@TASKS.register`), so adding a task is its file (or folder) plus conf/task/<name>.yaml: no list to edit.
"""

import importlib
import pkgutil

from kvbench.tasks.base import TASKS, Example, Task, build_task

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
# an integration drives the engine itself, so it lives above the engine and registers itself when first asked for
TASKS.lazy("lm_eval", "kvbench.integrations.lm_eval_task")

__all__ = ["TASKS", "Example", "Task", "build_task"]
