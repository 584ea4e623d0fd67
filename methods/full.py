"""The uncompressed cache: the baseline every method is compared with."""

from dataclasses import dataclass

from kvbench.methods.base import METHODS, Method


@METHODS.register("full")
@dataclass
class Full(Method):
    """Keeps every token in full precision (a plain transformers DynamicCache)."""

    has_budget = False
    family = "none"
