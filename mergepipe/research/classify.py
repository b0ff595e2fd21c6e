"""Behaviour of encoder merges: sentence classification with a per-task head kept outside the merge.

The FusionBench GLUE protocol: each expert is an encoder fine-tuned together with its own linear
classification head; a merge combines the encoders only, and task t is scored with the merged
encoder plus task t's head. Sentence embedding = mean of the last hidden states over the real tokens
(sentence-transformers' pooling for all-MiniLM-L6-v2). A head is a ``torch.nn.Linear`` stored as a
safetensors file with ``weight`` [classes, hidden] and ``bias`` [classes].

transformers is imported lazily (optional extra ``[eval]``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mergepipe.errors import MergePipeError


def default_device() -> str:
    """Where encoders run: the GPU when torch sees one (training and evaluation only; merges never)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_encoder(model_dir, device: str | None = None):
    """The encoder (``AutoModel``) in float32, eval mode, on ``device`` (default: :func:`default_device`),
    and its tokenizer."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, KeyError) as exc:
        raise MergePipeError(f"{model_dir}: cannot load as an encoder ({str(exc).splitlines()[0]})") from None
    model.eval()
    return model.to(device or default_device()), tok


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def embed(model, tok, sentences: list[str], batch_size: int = 128, max_length: int = 48,
          grad: bool = False) -> torch.Tensor:
    """Mean-pooled last hidden states, one row per sentence (on the CPU, wherever the model runs)."""
    device = next(model.parameters()).device
    rows = []
    for i in range(0, len(sentences), batch_size):
        x = tok(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                return_tensors="pt").to(device)
        with torch.set_grad_enabled(grad):
            h = model(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).last_hidden_state
        rows.append(mean_pool(h, x["attention_mask"]).cpu())
    return torch.cat(rows)


def save_head(head: torch.nn.Linear, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # parallel builders may write the same probe
    save_file({"weight": head.weight.detach().contiguous(), "bias": head.bias.detach().contiguous()}, str(tmp))
    os.replace(tmp, path)


def load_head(path) -> torch.nn.Linear:
    t = load_file(str(path))
    head = torch.nn.Linear(t["weight"].shape[1], t["weight"].shape[0])
    with torch.no_grad():
        head.weight.copy_(t["weight"])
        head.bias.copy_(t["bias"])
    return head


@torch.no_grad()
def head_accuracy(features: torch.Tensor, head: torch.nn.Linear, labels) -> float:
    pred = head(features).argmax(-1)
    return float((pred == torch.as_tensor(labels)).float().mean())


def fit_probe(features: torch.Tensor, labels, classes: int, steps: int = 300, weight_decay: float = 1e-4,
              seed: int = 0) -> torch.nn.Linear:
    """A linear probe (multinomial logistic regression) on frozen features, full-batch LBFGS; the
    features are standardised and the scaling folded back into the returned head."""
    y = torch.as_tensor(labels)
    mu, sd = features.mean(0), features.std(0).clamp(min=1e-6)
    z = (features - mu) / sd
    torch.manual_seed(seed)
    lin = torch.nn.Linear(features.shape[1], classes)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(z), y) + weight_decay * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    head = torch.nn.Linear(features.shape[1], classes)
    with torch.no_grad():
        head.weight.copy_(lin.weight / sd)
        head.bias.copy_(lin.bias - (lin.weight * mu / sd).sum(1))
    return head


def merged_accuracy(model_dir, heads: dict, suite: dict, batch_size: int = 128) -> dict:
    """Per-task accuracy of one encoder with each task's head: ``heads[t]`` a Linear or a head file,
    ``suite[t]`` a list of (sentence, label). Returns per_task and the unweighted mean."""
    model, tok = load_encoder(model_dir)
    per_task = {}
    for name, pairs in suite.items():
        if not pairs:
            raise ValueError(f"task {name!r} has no examples")
        head = heads[name] if isinstance(heads[name], torch.nn.Linear) else load_head(heads[name])
        feats = embed(model, tok, [s for s, _ in pairs], batch_size)
        per_task[name] = head_accuracy(feats, head, [y for _, y in pairs])
    return {"per_task": per_task, "mean": sum(per_task.values()) / len(per_task)}
