"""KV-cache compression methods, one file each, registered by name (= conf/method/<name>.yaml).

Every module of this package is imported here, so a method registers itself by existing: no list to keep.
"""

import importlib
import pkgutil

from kvbench.methods.base import METHODS, Budget, Capabilities, Method, build_method, method_defaults, scorer_names

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "METHODS",
    "Budget",
    "Capabilities",
    "Method",
    "build_method",
    "method_defaults",
    "scorer_names",
]
