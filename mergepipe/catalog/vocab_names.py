"""Which tensors hold the vocabulary, by name: the embeddings and output heads whose rows are tokens.

A leaf module (no mergepipe imports) shared by :mod:`mergepipe.catalog.mismatch` and
:mod:`mergepipe.catalog.models` (which re-exports both names)."""

from __future__ import annotations

VOCAB_TENSOR_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "wte.weight", "word_embeddings.weight",
                         "embed_out.weight", "embed_in.weight", "shared.weight")


def is_vocab_tensor(name: str) -> bool:
    """An embedding or output tensor whose rows are the vocabulary (by name)."""
    return name.endswith(VOCAB_TENSOR_SUFFIXES)
