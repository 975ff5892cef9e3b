"""The disk: agent cache files (the warm tier), shared prefix files, the cold index, conversations, export.

It knows nothing of agents' pools or the engine: the runtime hands it plain
records (``kv_at_rest.CacheAtRest``, ``warm_store.AgentFile``,
``cold_index.ColdEntry``) and gets ``layer_slice.LayerSlice``s back. File
work runs on an I/O thread; ``to_mlx`` turns what it read into MLX arrays on
the engine thread.
"""
