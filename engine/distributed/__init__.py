"""One model across several processes or machines, on MLX's own distributed backend."""
