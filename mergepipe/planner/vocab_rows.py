"""Planning the embedding rows of a merge over different vocabularies (a request's ``tokenizer["vocab"]``,
config/vocab.py).

Budget semantics: the embed_tokens/lm_head rows of every model are re-ordered to the output vocabulary
(mergekit's PermutedVocabulary), and a row of the output may come from another model (a token only some
experts have: its row for every model), from a mean over models, or from every row (the padding rows).
MergePipe therefore reads these tensors in full, for the base and for every expert, whatever the
budget: they are reserved first (``vocab_bytes``) and the budget's remainder is planned over the other
tensors as usual. No block of them is ever omitted, so the merged rows equal mergekit's at any budget
and the error bound covers the other tensors only. A budget below the reserved bytes is refused.
"""

from __future__ import annotations

import json

import numpy as np

from mergepipe.catalog import analyses

from mergepipe.errors import PlanError
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.safetensors import TensorInfo


def vocab_of(request) -> dict | None:
    return (request.tokenizer or {}).get("vocab")


def check_shapes(catalog, op, base: dict, experts: list[dict], vocab: dict | None) -> None:
    """Without a vocabulary setting every expert's embedding rows must be the base's; with one, the
    experts must be the models whose rows it re-orders."""
    if vocab is None:
        full = [e["id"] for e in experts if e["kind"] == "full"]
        found = {}
        for mid, name, shape, want in (analyses.shape_mismatches(catalog, base["id"], full) if full else ()):
            found.setdefault(mid, (name, json.loads(shape), json.loads(want)))
        for mid in full:
            if mid in found:
                name, shape, want = found[mid]
                raise PlanError(f"expert {mid}'s {name} has {shape[0]} rows, the base's {want[0]} "
                                f"(another vocabulary): merge it from a config with `tokenizer_source` (union, "
                                f"base or a model), which re-orders the embedding rows to one tokenizer")
        return
    if vocab.get("copies"):  # passthrough: each embedding tensor copied from one model, re-ordered alone
        return
    have = sorted(e["id"] for e in experts)
    want = sorted(m for m in vocab["row_models"] if m != base["id"])
    if have != want:
        raise PlanError(f"the vocabulary setting re-orders the rows of {', '.join(want)}, but the experts are "
                        f"{', '.join(have)}")


def reserved(catalog, experts: list[dict], vocab: dict | None) -> dict[str, int]:
    """Bytes each expert's embedding tensors cost (read in full; passthrough: none, a copied tensor is a read
    of the model it copies, as any copy)."""
    if vocab is None:
        return {}
    if vocab.get("copies"):
        return {e["id"]: 0 for e in experts}
    out = {}
    for e in experts:
        sizes = {t["name"]: t["nbytes"] for t in catalog.tensors(e["id"])}
        out[e["id"]] = sum(sizes[n] for n in vocab["tensors"])
    return out


def output_info(row: dict, vocab: dict) -> TensorInfo:
    """A base tensor's output shape (its re-ordered rows for an embedding tensor)."""
    shape = tuple(vocab["tensors"].get(row["name"], row["shape"]))
    itemsize = row["nbytes"] // max(1, int(np.prod(row["shape"])))
    return TensorInfo(row["name"], row["dtype"], shape, row["file"], row["offset"], int(np.prod(shape)) * itemsize)


def access(rows: list[dict], vocab: dict, block_bytes: int) -> dict[str, list[list[int]]]:
    """Every block of every re-ordered tensor (in the output's grid)."""
    out = {}
    for row in rows:
        if row["name"] in vocab["tensors"]:
            out[row["name"]] = [[0, len(tensor_grid(output_info(row, vocab), block_bytes))]]
    return out


def budget_rest(budget_bytes: int, vocab_total: int, spec: str) -> int:
    """The budget left for the other tensors; refused when it cannot pay for the embedding rows."""
    if budget_bytes < vocab_total:
        raise PlanError(f"budget {spec} ({budget_bytes} B) is below the embedding rows a re-ordered vocabulary "
                        f"reads in full ({vocab_total} B, tokenizer_source): raise the budget")
    return budget_bytes - vocab_total
