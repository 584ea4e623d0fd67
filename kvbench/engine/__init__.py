"""The engine: prefill, compression and decode of one example — alone, batched, as a grid, inline, streaming,
with a prefix cache."""
