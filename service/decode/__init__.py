"""Incremental decoding: live sequences, their steps, the step runner."""
