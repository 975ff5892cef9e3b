"""Continuous batching over resident caches (replaces mlx-lm's BatchGenerator in the engine)."""
