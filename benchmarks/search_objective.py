"""The recipe-search benchmark's objectives on family A (all-MiniLM-L6-v2 experts, heads outside the merge):
mean accuracy over the merged tasks, each scored with the merged encoder and that task's own head
(FusionBench's protocol, as in docs/fidelity).

``validation`` scores the validation sentences (neither trained on nor reported); ``heldout`` the held-out
sentences the fidelity study reports. Configured by the environment, read once per process:
SEARCH_FAMILY (the family directory) and SEARCH_TASKS (comma-separated task names)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch

from benchmarks.fidelity.encoder import EncoderSpec, data, load_spec, validation as validation_sentences
from mergepipe import api
from mergepipe.research.classify import embed, head_accuracy, load_head


@lru_cache(maxsize=1)
def _setup() -> dict:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    family = Path(os.environ["SEARCH_FAMILY"])
    tasks = os.environ["SEARCH_TASKS"].split(",")
    spec = load_spec(family) or EncoderSpec()
    return {"family": family, "tasks": tasks, "tokenizer": AutoTokenizer.from_pretrained(str(family / "base")),
            "heads": {t: load_head(family / "heads" / "full" / f"{t}.safetensors") for t in tasks},
            "validation": {t: validation_sentences(t, spec) for t in tasks},
            "heldout": {t: data(t, spec)[1] for t in tasks}}


def encoder_accuracy(model, split: str) -> float:
    """Mean accuracy (%) of an encoder over the tasks of ``split`` ("validation" or "heldout")."""
    s = _setup()
    scores = []
    with torch.no_grad():
        for task, pairs in s[split].items():
            feats = embed(model, s["tokenizer"], [x for x, _ in pairs])
            scores.append(head_accuracy(feats, s["heads"][task], [y for _, y in pairs]))
    return 100.0 * sum(scores) / len(scores)


def _score(tensors: dict, split: str) -> float:
    torch.set_num_threads(int(os.environ.get("SEARCH_THREADS", "1")))
    model = api.load_into_model(tensors, _setup()["family"] / "base", auto_class="AutoModel")
    return encoder_accuracy(model, split)


def validation(tensors: dict) -> float:
    return _score(tensors, "validation")


def heldout(tensors: dict) -> float:
    return _score(tensors, "heldout")
