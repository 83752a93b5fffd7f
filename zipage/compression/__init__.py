"""Compressed PagedAttention: token scoring and selection for KV-cache eviction."""
