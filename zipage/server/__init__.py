"""OpenAI-compatible HTTP server: ``zipage serve MODEL_DIR``."""
