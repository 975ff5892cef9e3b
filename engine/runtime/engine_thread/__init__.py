"""The engine thread: it owns MLX, the model and the pool; others talk to it through its queue and snapshot."""
