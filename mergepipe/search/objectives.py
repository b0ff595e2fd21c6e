"""What a search maximizes: a score of merged weights held in memory (higher is better).

* ``tasks``: the mean accuracy on a task suite (JSONL: exact match, or log-likelihood multiple choice),
* ``text``: perplexity on a text, scored as its negative (``-perplexity``),
* ``python``: ``module:function`` (or ``path/file.py:function``) called with the merged state dict (tensor
  name -> torch tensor); :func:`load_into_model` builds a transformers model from it with the base's config.

Each objective is prepared once (files read and parsed, the function imported) and then scores trials.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from pathlib import Path

from mergepipe.errors import MergePipeError
from mergepipe.search.settings import Objective


class TrialFailed(MergePipeError):
    """A trial's objective raised or returned no number: the trial fails, the search goes on."""


def prepare(objective: Objective, base_dir) -> "Scorer":
    if objective.kind == "python":
        return PythonScorer(objective)
    return ModelScorer(objective, base_dir)


class PythonScorer:
    def __init__(self, objective: Objective):
        self.metric = objective.target.rpartition(":")[2]
        self.fn = load_function(objective.target)

    def __call__(self, tensors: dict) -> float:
        try:
            value = self.fn(tensors)
        except Exception as exc:  # the user's code: any failure fails this trial only
            raise TrialFailed(f"{self.metric} raised {type(exc).__name__}: {str(exc)[:300]}") from None
        return _number(value, self.metric)


class ModelScorer:
    """A task suite or a text, scored with a causal LM built from the merged tensors."""

    def __init__(self, objective: Objective, base_dir):
        from mergepipe.evaluation.inputs import suite_job, text_job
        from mergepipe.evaluation.model_loading import load_tokenizer
        self.objective, self.base_dir = objective, base_dir
        self.job = suite_job(objective.target) if objective.kind == "tasks" else \
            text_job(objective.target, objective.window, objective.max_tokens)
        self.metric = self.job["metric"]
        self.tokenizer = load_tokenizer(base_dir)

    def __call__(self, tensors: dict) -> float:
        from mergepipe.evaluation.scoring import perplexity, score_task_suite
        model = load_into_model(tensors, self.base_dir)
        if self.objective.kind == "tasks":
            return score_task_suite(model, self.job["suite"], self.tokenizer)["mean"]
        return -perplexity(model, self.job["text"], self.tokenizer, self.objective.window,
                           self.objective.max_tokens)["perplexity"]


def load_into_model(tensors: dict, base_dir, auto_class: str = "AutoModelForCausalLM"):
    """A transformers model (float32, eval mode) with the base's config and the merged ``tensors``; every
    weight of the model must come from them (a tied output embedding may be absent)."""
    import torch

    from mergepipe.evaluation.model_loading import import_transformers
    from mergepipe.storage.tokenizer_files import checked_folder
    transformers = import_transformers()
    with checked_folder(base_dir) as folder:
        config = transformers.AutoConfig.from_pretrained(str(folder))
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32)
    state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())  # loaded through the input embedding
    missing = [m for m in missing if m not in tied]
    buffers = {name for name, _ in model.named_buffers()}  # e.g. position_ids, kept out of the state dict
    unexpected = [u for u in unexpected if u not in buffers]
    if missing or unexpected:
        raise MergePipeError(f"the merged tensors do not fit {config.model_type}: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval()


def load_function(target: str):
    """``module:function`` or ``path/file.py:function``; one clear error when it cannot be imported."""
    module_name, _, func = target.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"mergepipe_objective_{Path(module_name).stem}",
                                                          module_name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise MergePipeError(f"objective {target}: cannot import {module_name} ({type(exc).__name__}: "
                             f"{str(exc)[:200]})") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise MergePipeError(f"objective {target}: {module_name} has no function {func!r}")
    return fn


def _number(value, metric: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TrialFailed(f"{metric} returned {type(value).__name__}, not a number") from None
    if not math.isfinite(number):
        raise TrialFailed(f"{metric} returned {number}")
    return number
