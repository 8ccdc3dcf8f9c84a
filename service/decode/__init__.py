"""Incremental decoding: live sequences and their caches, and the batcher of their steps."""
