"""The composition root: the server process, the worker supervisor, launching."""
