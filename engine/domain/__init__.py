"""Domain core: pure Python, no MLX import. Block accounting, cache layout, errors."""
