"""Serving many requests: the batching scheduler, sessions, KV spill."""
