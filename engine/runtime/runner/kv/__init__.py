"""The KV a sequence attends to: per-layer caches that stay resident between turns.

A hot agent's cache lives here in the layout the model consumes, so a turn
runs on it directly: nothing is gathered before a turn or cut after it. The
block pool counts these arrays in blocks (their capacity is always a whole
number of blocks); blocks are materialized as separate arrays only where
they must be (the disk tier).
"""
