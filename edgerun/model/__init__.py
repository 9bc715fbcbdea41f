"""The transformer over its weights: one layer definition (layer.py), the bound decode
step, weight stores and FFN executors, the KV cache."""
