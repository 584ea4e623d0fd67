"""KV-cache compression methods, one file each, registered by name (= conf/method/<name>.yaml)."""

from kvbench.methods.base import METHODS, Budget, Method, build_method, method_defaults

# isort: split
# Importing a method's module registers it (compose last: it builds the others by name).
from kvbench.methods import full, h2o, headmerge, hf_quant, kivi, pyramidkv, random_eviction, snapkv, streamingllm  # noqa: F401

# isort: split
from kvbench.methods import adakv, decoding, expected_attention, keydiff, knorm, tova  # noqa: F401

# isort: split
from kvbench.methods import compose  # noqa: F401

__all__ = ["METHODS", "Budget", "Method", "build_method", "method_defaults"]
