"""The model runner: the batch of sequences, each one's resident KV, sampling, text, and compute backends."""
