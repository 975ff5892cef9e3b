"""Everything that runs on the engine thread, by role (imports point down this list).

``engine_thread/``: the thread that owns MLX, its command queue and snapshot.
``scheduler/``: turns through the batch: admission, a turn's cache, stepping, completion.
``tiers/``: where each agent's cache is (hot, cool, warm, cold), and fork and rewind.
``runner/``: the model runner: the batch, each sequence's KV, sampling, compute backends.
``clock.py`` and ``meters.py`` serve all of them.
"""
