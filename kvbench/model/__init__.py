"""Models: loading (registry of loaders), attention statistics, RoPE, cache layers and their byte accounting."""
