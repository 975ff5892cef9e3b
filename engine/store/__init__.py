"""The warm tier on disk: one safetensors file per agent's KV cache.

``cache_file`` writes and validates the files without touching MLX (it runs on
the I/O thread); ``to_mlx`` turns what it read into MLX blocks on the engine
thread; ``file_names`` maps agent ids to safe file names.
"""
