"""Tasks: each builds token-level examples from a config and scores predictions with a pure metric function."""

from kvbench.tasks.base import TASKS, Example, Task, build_task

from kvbench.tasks import niah  # noqa: F401,E402  (registers)
from kvbench.tasks import longbench  # noqa: F401,E402
from kvbench.tasks import ppl  # noqa: F401,E402
from kvbench.tasks import ruler  # noqa: F401,E402
from kvbench.tasks import longgen  # noqa: F401,E402

__all__ = ["TASKS", "Example", "Task", "build_task"]
