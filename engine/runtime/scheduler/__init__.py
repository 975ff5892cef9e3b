"""Turns through the batch: which enter it (admission), their caches, each step's outcome, how they end."""
