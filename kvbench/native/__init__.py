"""kvbench's own engine, in this process on the loaded model: prefill, compression and decode of one example — alone,
batched, as a grid, inline, streaming, with a prefix cache. (The serving engines, each in its own process, are
kvbench.engines.)"""
