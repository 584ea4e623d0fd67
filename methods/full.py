"""The uncompressed cache: the baseline every method is compared with."""

from dataclasses import dataclass

from kvbench.methods.base import METHODS, Capabilities, Method


@METHODS.register("full")
@dataclass
class Full(Method):
    """Keeps every token in full precision (a plain transformers DynamicCache)."""

    caps = Capabilities(family="none", has_budget=False)
