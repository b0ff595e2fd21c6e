"""Storage: the safetensors format and byte-exact reads from checkpoints (the lowest layer)."""
