"""Behaviour: scoring a causal LM by exact-match accuracy (greedy decoding), perplexity on a held-out text,
and task suites (multiple choice by log-likelihood, the rest by exact match)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mergepipe.config.task_suite import TaskExample
from mergepipe.errors import MergePipeError
from mergepipe.evaluation.model_loading import load_model, load_tokenizer


def check_scoring(window: int, max_tokens: int, names: tuple[str, str] = ("--window", "--max-tokens")) -> None:
    """Perplexity's window and token limit: whole numbers of at least 2 tokens (one prediction)."""
    for name, value in zip(names, (window, max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            shown = value if isinstance(value, int) and value.bit_length() <= 64 else "that"
            raise MergePipeError(f"{name} must be a whole number of at least 2 tokens, not {shown}")


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 256) -> list[str]:
    """Greedy continuation of each prompt (``<s>`` + prompt), decoded up to ``</s>``.

    Prompts are batched by token length, so no padding (and no position-id bookkeeping) is needed;
    ``model.generate`` (greedy, KV cache) stops a batch once every sequence has produced ``</s>``."""
    encoded = [tokenizer.encode(p, bos=True) for p in prompts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out: list[str] = [""] * len(prompts)
    pad = getattr(tokenizer, "pad_id", None)
    for n, members in sorted(by_len.items()):
        for start in range(0, len(members), batch_size):
            idx = members[start:start + batch_size]
            seq = torch.tensor([encoded[i] for i in idx], dtype=torch.long)
            gen = model.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tokenizer.eos_id,
                                 pad_token_id=tokenizer.eos_id if pad is None else pad)
            for row, i in enumerate(idx):
                out[i] = tokenizer.decode(gen[row, n:].tolist())
    return out


def accuracy(model_or_dir, suite: dict[str, list[tuple[str, str]]], tokenizer=None, batch_size: int = 256,
             return_outputs: bool = False) -> dict:
    """Exact-match accuracy per task and their unweighted mean.

    ``suite`` maps a task name to (prompt, answer) pairs. A prediction is correct when the greedy
    continuation up to ``</s>`` equals the answer exactly; generation stops after the longest answer
    + 1 tokens, so a model that never emits ``</s>`` is never counted correct."""
    model, tokenizer = _model_and_tokenizer(model_or_dir, tokenizer)
    per_task, outputs = {}, {}
    for name, pairs in suite.items():
        if not pairs:
            raise ValueError(f"task {name!r} has no examples")
        prompts = [p for p, _ in pairs]
        max_new = max(len(tokenizer.encode(a)) for _, a in pairs) + 1
        got = greedy_answers(model, tokenizer, prompts, max_new, batch_size)
        per_task[name] = sum(g == a for g, (_, a) in zip(got, pairs)) / len(pairs)
        outputs[name] = got
    res = {"per_task": per_task, "mean": sum(per_task.values()) / len(per_task)}
    if return_outputs:
        res["outputs"] = outputs
    return res


@torch.no_grad()
def perplexity(model_or_dir, text: str, tokenizer=None, window: int = 256, max_tokens: int = 8192,
               progress=None) -> dict:
    """Perplexity of a causal LM on ``text``: non-overlapping windows of ``window`` tokens (the first
    ``max_tokens`` tokens of the text), exp of the mean next-token negative log-likelihood.
    ``progress(done, total)`` is called after each window. Returns {'perplexity', 'nll', 'tokens'}."""
    check_scoring(window, max_tokens, ("window", "max_tokens"))
    model = load_model(model_or_dir) if isinstance(model_or_dir, (str, Path)) else model_or_dir
    tok = tokenizer or load_tokenizer(model_or_dir)
    try:
        ids = tok.encode(text)[:max_tokens]
    except KeyError as exc:
        raise MergePipeError(f"the text holds a character the model's vocabulary lacks: {exc}") from None
    if len(ids) < 2:
        raise MergePipeError("the text is too short to score (fewer than 2 tokens)")
    chunks = [ids[i:i + window] for i in range(0, len(ids), window)]
    chunks = [c for c in chunks if len(c) >= 2]
    total_nll, count = 0.0, 0
    for k, chunk in enumerate(chunks):
        x = torch.tensor([chunk], dtype=torch.long)
        logits = model(input_ids=x).logits.float()
        logp = torch.log_softmax(logits[0, :-1], dim=-1)
        nll = -logp.gather(1, x[0, 1:].unsqueeze(1)).sum().item()
        total_nll += nll
        count += len(chunk) - 1
        if progress:
            progress(k + 1, len(chunks))
    mean = total_nll / count
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": count}


# --- task suites (the dashboard's and `mergepipe evaluate --tasks`) -----------------------------------
@torch.no_grad()
def choice_loglik(model, tokenizer, prompt: str, choice: str) -> float:
    """log p(choice tokens | <s> + prompt tokens), summed over the choice's tokens."""
    ctx = tokenizer.encode(prompt, bos=True)
    cont = tokenizer.encode(choice)
    if not cont:
        raise MergePipeError(f"the choice {choice!r} encodes to no tokens")
    x = torch.tensor([ctx + cont], dtype=torch.long)
    logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    return float(logp[pos, torch.tensor(cont)].sum())


def score_task_suite(model_or_dir, suite: dict[str, list[TaskExample]], tokenizer=None, progress=None) -> dict:
    """Accuracy per task (multiple choice by log-likelihood, the rest by exact match) and their unweighted
    mean; ``progress(done, total)`` after each task. Returns {'per_task', 'mean', 'examples'}."""
    model, tokenizer = _model_and_tokenizer(model_or_dir, tokenizer)
    per_task = {}
    for k, (name, examples) in enumerate(suite.items()):
        mc = [e for e in examples if e.choices]
        gen = [e for e in examples if not e.choices]
        correct = 0
        for e in mc:
            scores = [choice_loglik(model, tokenizer, e.prompt, c) for c in e.choices]
            correct += e.choices[scores.index(max(scores))] == e.answer
        if gen:
            correct += round(accuracy(model, {name: [(e.prompt, e.answer) for e in gen]}, tokenizer)["mean"] * len(gen))
        per_task[name] = correct / len(examples)
        if progress:
            progress(k + 1, len(suite))
    return {"per_task": per_task, "mean": sum(per_task.values()) / len(per_task),
            "examples": sum(len(v) for v in suite.values())}


def _model_and_tokenizer(model_or_dir, tokenizer):
    """A model folder's model and tokenizer (loaded), or a model object with the tokenizer it must come with."""
    if isinstance(model_or_dir, (str, Path)):
        tokenizer = tokenizer or load_tokenizer(model_or_dir)  # first, as before: its errors come first
        return load_model(model_or_dir), tokenizer
    if tokenizer is None:
        raise ValueError("pass the tokenizer with a model object")
    return model_or_dir, tokenizer
