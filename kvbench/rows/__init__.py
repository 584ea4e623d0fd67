"""A row's identity and its columns: what a configuration is, what keys its rows in the store, and the one builder
every row goes through.

configuration.py  a run's configurations: the full-cache baseline + the requested (method, budget) pairs, or a
                  serving engine's options
modes.py          the run modes in one table: when each is active, which combine (the entrance refuses the rest),
                  what each adds to the config hash and the rows
config_hash.py    the hash that keys a configuration's rows in the store (what decides whether a stored row is reused)
build.py          the rows of one example: `row_for` (provenance + measured columns) and the builders for generated
                  answers, perplexity streams and serving engines; `RowContext`, what every row of a run shares

(kvbench.preflight checks a run before it starts; kvbench.run executes it; kvbench.store keeps the rows.)"""
