"""Serving engines as kvbench backends (base.py: the interface; protocol.py: the worker protocol)."""
