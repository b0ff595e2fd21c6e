"""The one-line refusal of an expert that does not match its base.

A few differences are listed whole; many (an expert registered against another model's base) are
summarized -- each model's layer count, vocabulary and dtype, the first differing tensor and how many
differ -- and the full list travels on the error (``details``: ``mergepipe register --verbose`` prints it)."""

from __future__ import annotations

import re
from collections import Counter

from mergepipe.catalog.vocab_names import is_vocab_tensor
from mergepipe.errors import CatalogError
from mergepipe.storage.safetensors import Checkpoint

# Listed whole up to this many differences and characters; summarized beyond.
LIST_AT_MOST = 3
LIST_CHARS = 200
OTHER_VOCAB = "(another vocabulary size)"
OTHER_VOCAB_NOTE = ("a model with another vocabulary is merged by re-ordering its embedding rows to one tokenizer "
                    "(tokenizer_source) and needs the model's tokenizer files next to its weights")
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")


def mismatch_error(model_id: str, base_id: str, problems: list[str], base: Checkpoint | None = None,
                   expert: Checkpoint | None = None) -> CatalogError:
    """The error refusing ``model_id`` against ``base_id``; ``problems`` (all of them) are its ``details``."""
    head = f"{model_id} does not match base {base_id}: "
    joined = "; ".join(problems)
    if len(problems) <= LIST_AT_MOST and len(joined) <= LIST_CHARS:
        body = joined
    else:
        body = _summary(problems, base, expert)
    if any(p.endswith(OTHER_VOCAB) for p in problems):
        body += "; " + OTHER_VOCAB_NOTE
    err = CatalogError(head + body)
    err.details = list(problems)
    return err


def _summary(problems: list[str], base: Checkpoint | None, expert: Checkpoint | None) -> str:
    parts = []
    if base is not None and expert is not None:
        parts.append(f"expert has {describe(expert)}; base has {describe(base)}")
    first = next((p for p in problems if ": shape " in p), problems[0])  # a shape tells most
    parts.append(f"first difference: {first if len(first) <= 120 else first[:117] + '...'}")
    parts.append(f"{len(problems)} differences in all (`mergepipe register --verbose` lists them)")
    return "; ".join(parts)


def describe(ckpt: Checkpoint) -> str:
    """'24 layers, vocab 32000, BF16': what tells two models apart at a glance (parts it cannot tell are
    left out)."""
    layers = {int(m.group(1)) for name in ckpt.tensors if (m := _LAYER.search(name))}
    parts = [f"{len(layers)} layers"]
    vocab = vocab_size(ckpt)
    if vocab is not None:
        parts.append(f"vocab {vocab}")
    dtypes = Counter(t.dtype for t in ckpt.tensors.values())
    if dtypes:
        parts.append(dtypes.most_common(1)[0][0])
    return ", ".join(parts)


def vocab_size(ckpt: Checkpoint) -> int | None:
    """The rows of the input embedding (or of any vocabulary tensor), or None when there is none."""
    names = sorted(n for n in ckpt.tensors if is_vocab_tensor(n) and len(ckpt.tensors[n].shape) == 2)
    names.sort(key=lambda n: "embed" not in n)
    return ckpt.tensors[names[0]].shape[0] if names else None
