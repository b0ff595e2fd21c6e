"""ANALYZE: per-block statistics of registered models."""
