"""Merge fidelity: how far a budgeted merge is from the full-budget merge, and what it can still do.

Two kinds of measurement, both for any model directory (a registered checkpoint or a merge output):

* **Weight space** (:func:`deviation`). For a budgeted merge ``M_A``, the full-budget merge ``M_full``
  of the same operator and parameters, and the base ``B`` (all tensors as float32, flattened together
  into one vector, non-float tensors ignored):

  - ``relative``       = ||M_A - M_full||_2 / ||M_full||_2
    The *relative l2 deviation* the MergePipe paper reports ("8.84e-4 at budget 0.5"): deviation of
    the budgeted merge from the full-budget merge, relative to the size of the full-budget model.
  - ``relative_delta`` = ||M_A - M_full||_2 / ||M_full - B||_2
    The same deviation relative to the size of the merged *update*. This is what the planner's error
    bound is expressed in (``plan["error_bound"]["relative"]``), and a much stricter scale: fine-tuning
    deltas are small next to the weights.
  - ``absolute``       = ||M_A - M_full||_2, comparable with ``plan["error_bound"]["absolute"]``.

  :func:`bound_check` compares the realized absolute deviation with the plan's bound (additive
  operators, invariant 3: realized <= bound).

* **Behaviour** (:func:`accuracy`). Per-task exact-match accuracy and their mean, by greedy decoding
  with the model. Tasks are passed in as ``{task name: [(prompt, answer), ...]}``, so the library does
  not depend on any particular task suite. Models with a ``vocab.json`` whose tokens are single
  characters plus ``<pad>``, ``<s>``, ``</s>`` use :class:`CharTokenizer` (the fidelity family in
  ``benchmarks/fidelity`` does); other models use ``transformers.AutoTokenizer``.

transformers is imported lazily (optional extra ``[eval]``). Every file it loads (config, weights, tokenizer)
comes from a checked copy of the model folder (:func:`~mergepipe.storage.tokenizer_files.checked_folder`), and
held-out texts and task suites are read through the same path checks ($MERGEPIPE_ALLOWED_ROOTS).

CLI::

    python -m mergepipe.evaluate accuracy MODEL_DIR --tasks SUITE.jsonl [--json]
    python -m mergepipe.evaluate deviation MODEL_DIR --reference FULL_DIR [--base BASE_DIR] [--json]

``SUITE.jsonl`` holds one ``{"task": ..., "prompt": ..., "answer": ...}`` object per line
(``python -m benchmarks.fidelity.tasks --write SUITE.jsonl`` writes the fidelity suite).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from mergepipe.config.task_suite import (  # noqa: F401  (the format lives in config)
    TaskExample, parse_task_suite, read_task_suite,
)
from mergepipe.errors import MergePipeError
from mergepipe.storage.paths import check_allowed, read_regular
from mergepipe.storage.safetensors import FLOAT_DTYPES, open_checkpoint
from mergepipe.storage.tokenizer_files import checked_folder

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
INSTALL_HINT = "evaluating a model needs transformers, which is not installed: pip install 'mergepipe[eval]'"
MAX_TEXT_BYTES = 256 << 20  # a held-out text or task suite


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise MergePipeError(INSTALL_HINT) from None
    return transformers


def read_eval_file(path, label: str = "") -> bytes:
    """The bytes of a held-out text or task suite: inside the allowed roots (symlinks followed), a regular
    file, at most MAX_TEXT_BYTES; ``label`` prefixes the errors (``evaluate.text: ``)."""
    try:
        check_allowed(path)
        if not Path(path).is_file():
            raise MergePipeError(f"{path} is not a file")
        return read_regular(path, MAX_TEXT_BYTES)
    except MergePipeError as exc:
        raise MergePipeError(f"{label}{exc}") from None


def check_scoring(window: int, max_tokens: int, names: tuple[str, str] = ("--window", "--max-tokens")) -> None:
    """Perplexity's window and token limit: whole numbers of at least 2 tokens (one prediction)."""
    for name, value in zip(names, (window, max_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            shown = value if isinstance(value, int) and value.bit_length() <= 64 else "that"
            raise MergePipeError(f"{name} must be a whole number of at least 2 tokens, not {shown}")


def text_job(path, window: int, max_tokens: int) -> dict:
    """A held-out text to score by perplexity (``mergepipe evaluate --text``), read through the path checks.
    ``dataset`` keys a stored result: the text's sha256 with the window and token limit, which change it."""
    check_scoring(window, max_tokens)
    data = read_eval_file(path)
    return {"metric": "perplexity", "dataset": f"{_digest(data)};window={window};max_tokens={max_tokens}",
            "name": Path(path).name, "text": data.decode("utf-8", errors="replace"), "window": window,
            "max_tokens": max_tokens}


def suite_job(path) -> dict:
    """A task suite to score (``mergepipe evaluate --tasks``): read once through the path checks, parsed
    before any model is loaded; ``dataset``: the file's sha256."""
    data = read_eval_file(path)
    return {"metric": "accuracy", "dataset": _digest(data), "name": Path(path).name,
            "suite": parse_task_suite(data, path)}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- weight space -----------------------------------------------------------------------------------
def load_tensors(model_dir) -> dict[str, torch.Tensor]:
    """Every floating-point tensor of a checkpoint, as float32."""
    ck = open_checkpoint(model_dir)
    out = {}
    for name, info in ck.tensors.items():
        if info.dtype not in FLOAT_DTYPES:
            continue
        path = ck.root / info.file if ck.root.is_dir() else ck.root
        with safe_open(str(path), framework="pt") as fh:
            out[name] = fh.get_tensor(name).float()
    return out


def deviation(model_dir, reference_dir, base_dir=None) -> dict:
    """||M - R||, ||M - R|| / ||R|| and (with a base) ||M - R|| / ||R - base|| over all float tensors.

    Accumulated in float64, tensor by tensor; the two checkpoints must have the same tensor names."""
    m, r = load_tensors(model_dir), load_tensors(reference_dir)
    b = load_tensors(base_dir) if base_dir is not None else None
    for other, label in ((r, reference_dir), (b, base_dir)):
        if other is None:
            continue
        if set(m) != set(other):
            raise MergePipeError(f"{model_dir} and {label} have different tensors: {sorted(set(m) ^ set(other))[:5]}")
        bad = [n for n in m if m[n].shape != other[n].shape]
        if bad:
            raise MergePipeError(f"{model_dir} and {label} differ in shape: {bad[0]} {list(m[bad[0]].shape)} "
                                 f"vs {list(other[bad[0]].shape)}")
    diff2 = ref2 = upd2 = 0.0
    per_tensor = {}
    for name in sorted(r):
        d = (m[name].double() - r[name].double())
        dn = float((d * d).sum())
        diff2 += dn
        ref2 += float((r[name].double() ** 2).sum())
        if b is not None:
            upd2 += float(((r[name].double() - b[name].double()) ** 2).sum())
        if dn > 0:
            per_tensor[name] = math.sqrt(dn)
    absolute = math.sqrt(diff2)
    out = {"absolute": absolute, "reference_norm": math.sqrt(ref2),
           "relative": absolute / math.sqrt(ref2) if ref2 > 0 else 0.0, "per_tensor": per_tensor}
    if b is not None:
        out["update_norm"] = math.sqrt(upd2)
        out["relative_delta"] = absolute / math.sqrt(upd2) if upd2 > 0 else 0.0
    return out


def bound_check(plan, dev: dict, rtol: float = 1e-5) -> dict:
    """Realized ||M_A - M_full|| against the plan's bound (additive operators); ``None`` when no bound.

    ``holds`` allows float32 rounding of the written weights (``rtol`` of the reference norm)."""
    bound = (plan.error_bound if not isinstance(plan, dict) else plan.get("error_bound"))
    if not bound:
        return None
    slack = rtol * dev.get("reference_norm", 0.0)
    return {"bound_absolute": bound["absolute"], "realized_absolute": dev["absolute"],
            "bound_relative": bound["relative"], "realized_relative_delta": dev.get("relative_delta"),
            "holds": dev["absolute"] <= bound["absolute"] + slack}


# --- behaviour --------------------------------------------------------------------------------------
class CharTokenizer:
    """One token per character; ids from ``vocab.json`` (token -> id) with ``<pad>``, ``<s>``, ``</s>``."""

    def __init__(self, tokens: list[str]):
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.bos_id, self.eos_id = self.index[PAD], self.index[BOS], self.index[EOS]

    @classmethod
    def from_dir(cls, model_dir) -> CharTokenizer:
        table = json.loads((Path(model_dir) / "vocab.json").read_text())
        tokens = [None] * len(table)
        for t, i in table.items():
            tokens[i] = t
        return cls(tokens)

    @staticmethod
    def applies(model_dir) -> bool:
        p = Path(model_dir) / "vocab.json"
        if not p.exists():
            return False
        try:
            table = json.loads(p.read_text())
        except ValueError:
            return False
        return isinstance(table, dict) and {PAD, BOS, EOS} <= set(table) and all(
            len(t) == 1 for t in table if t not in (PAD, BOS, EOS))

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [self.index[c] for c in text]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if self.tokens[i] not in (PAD, BOS, EOS):
                out.append(self.tokens[i])
        return "".join(out)

    def save(self, model_dir) -> None:
        (Path(model_dir) / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(self.tokens)}))

    def __len__(self) -> int:
        return len(self.tokens)


class _HFTokenizer:
    """Adapter so a transformers tokenizer looks like CharTokenizer to the decoding loop."""

    def __init__(self, model_dir, folder):
        """``folder``: the checked copy of ``model_dir``'s files that transformers reads."""
        auto = import_transformers().AutoTokenizer
        try:
            self.tok = auto.from_pretrained(str(folder))
        except (OSError, ValueError, KeyError, ImportError) as exc:
            raise MergePipeError(f"{model_dir}: no usable tokenizer ({_reason(exc, folder, model_dir)})") from None
        self.bos_id, self.eos_id = self.tok.bos_token_id, self.tok.eos_token_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir):
    with checked_folder(model_dir) as folder:
        return CharTokenizer.from_dir(folder) if CharTokenizer.applies(folder) else _HFTokenizer(model_dir, folder)


def load_model(model_dir):
    """The model in float32, eval mode (transformers imported here, lazily)."""
    transformers = import_transformers()
    transformers.utils.logging.disable_progress_bar()
    with checked_folder(model_dir, weights=True) as folder:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        except (OSError, ValueError, KeyError) as exc:
            raise MergePipeError(f"{model_dir}: cannot load as a causal LM ({_reason(exc, folder, model_dir)})") \
                from None
    model.eval()
    return model


def _reason(exc: Exception, folder: Path, model_dir) -> str:
    """The first line of a transformers error, naming the model folder rather than its checked copy."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__).replace(str(folder), str(model_dir))


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
    if isinstance(model_or_dir, (str, Path)):
        tokenizer = tokenizer or load_tokenizer(model_or_dir)
        model = load_model(model_or_dir)
    else:
        model = model_or_dir
        if tokenizer is None:
            raise ValueError("pass the tokenizer with a model object")
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


def read_suite(path) -> dict[str, list[tuple[str, str]]]:
    """A task suite as (prompt, answer) pairs per task (the format: :func:`read_task_suite`)."""
    return {name: [(ex.prompt, ex.answer) for ex in examples] for name, examples in read_task_suite(path).items()}


def write_suite(suite: dict[str, list[tuple[str, str]]], path) -> None:
    with open(path, "w") as fh:
        for name, pairs in suite.items():
            for p, a in pairs:
                fh.write(json.dumps({"task": name, "prompt": p, "answer": a}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mergepipe.evaluate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy", help="per-task exact-match accuracy of a model directory")
    a.add_argument("model_dir")
    a.add_argument("--tasks", required=True, help="JSONL suite: {task, prompt, answer} per line")
    a.add_argument("--json", action="store_true")
    d = sub.add_parser("deviation", help="relative l2 deviation of a model from a reference model")
    d.add_argument("model_dir")
    d.add_argument("--reference", required=True, help="the full-budget merge")
    d.add_argument("--base", help="the base model (adds the deviation relative to the merged update)")
    d.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except MergePipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.cmd == "accuracy":
        res = accuracy(args.model_dir, read_suite(args.tasks))
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            for name, acc in res["per_task"].items():
                print(f"{name:<16} {acc:.3f}")
            print(f"{'mean':<16} {res['mean']:.3f}")
    else:
        res = deviation(args.model_dir, args.reference, args.base)
        res.pop("per_tensor")
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"||M - R||            {res['absolute']:.6g}")
            print(f"||M - R|| / ||R||     {res['relative']:.6e}  (relative l2 deviation)")
            if "relative_delta" in res:
                print(f"||M - R|| / ||R - B|| {res['relative_delta']:.6e}  (relative to the merged update)")
    return 0


if __name__ == "__main__":
    sys.exit(main())


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
    if isinstance(model_or_dir, (str, Path)):
        tokenizer = tokenizer or load_tokenizer(model_or_dir)
        model = load_model(model_or_dir)
    else:
        model = model_or_dir
        if tokenizer is None:
            raise ValueError("pass the tokenizer with a model object")
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
