"""Model files: GGUF import into MLX model folders and the models that ship as pip packages."""
