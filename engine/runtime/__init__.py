"""The engine thread: one thread owns MLX, the model and the BatchGenerator."""
