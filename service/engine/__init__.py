"""The served model: numpy in, numpy out (batching, readiness, statistics)."""
