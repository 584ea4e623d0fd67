"""KV-cache compression methods, one file each, registered by name (= conf/method/<name>.yaml)."""

from kvbench.methods.base import METHODS, Budget, Method, build_method

# Importing a method's module registers it.
from kvbench.methods import full, h2o, headmerge, pyramidkv, random_eviction, snapkv, streamingllm  # noqa: F401,E402

__all__ = ["METHODS", "Budget", "Method", "build_method"]
