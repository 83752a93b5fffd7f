"""Attention backends behind one small interface (see ``backend.py``)."""

from zipage.attention.backend import AttentionBackend, select_backend
from zipage.attention.metadata import AttentionMetadata, get_attention_metadata, set_attention_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_metadata",
           "set_attention_metadata", "select_backend"]
