"""Build the fidelity family: a tiny Llama pretrained on a synthetic corpus, fine-tuned into K experts.

    python -m benchmarks.fidelity.train                 # full family -> benchmarks/work/fidelity/family
    python -m benchmarks.fidelity.train --mini --out DIR  # seconds-sized family (what the test builds)

Base: ``LlamaForCausalLM`` (d=128, 4 layers, ~1M parameters, character vocabulary of 41 tokens)
pretrained with next-token loss on a mix of generic synthetic text (90 %) and examples of all tasks
(10 %): a base that has seen the task formats is what lets simple merges keep a share of the experts'
skills (a base pretrained on generic text only made every merge collapse). Each expert starts from the
base and is fine-tuned on one task, with the loss on the answer tokens only.

Everything is seeded (model init, data, order): the same spec and seed give bit-identical weights on
the same machine and thread count. Each model directory is written to a temporary name and renamed
when complete; a directory that exists is skipped, so an interrupted build resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.fidelity.tasks import TASK_NAMES, TASKS, generic_text, task_line, tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "work" / "fidelity" / "family"


@dataclass(frozen=True)
class FamilySpec:
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 448
    max_len: int = 32
    batch: int = 64
    pretrain_steps: int = 1500
    pretrain_lr: float = 2e-3
    task_fraction: float = 0.25  # share of task examples in the pretraining mix
    generic_chars: tuple[int, int] = (12, 28)
    expert_steps: int = 300
    expert_lr: float = 1e-3
    tasks: tuple[str, ...] = TASK_NAMES
    seed: int = 0
    threads: int = 2


FULL = FamilySpec()
MINI = FamilySpec(hidden=32, layers=2, heads=2, intermediate=64, batch=32, pretrain_steps=60, pretrain_lr=3e-3,
                  task_fraction=0.3, expert_steps=30, expert_lr=1e-3, tasks=("reverse", "length", "max"),
                  threads=1)


def _seed(*parts) -> int:
    return zlib.crc32(json.dumps(parts).encode())


def _base_fields(spec: dict) -> dict:
    """The spec fields the base depends on (experts can be rebuilt with other settings on the same base)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.items()
            if k not in ("expert_steps", "expert_lr", "tasks")}


def llama_config(spec: FamilySpec, vocab_size: int):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        head_dim=spec.hidden // spec.heads, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_dropout=0.0)


def _row(ids: list[int], loss_from: int, max_len: int, pad: int) -> tuple[list[int], list[int]]:
    """Input ids and labels (-100 = no loss) for one sequence, right-padded to ``max_len``."""
    ids = ids[:max_len]
    labels = [(-100 if i < loss_from else t) for i, t in enumerate(ids)]
    n = max_len - len(ids)
    return ids + [pad] * n, labels + [-100] * n


def pretrain_batch(spec: FamilySpec, rng: random.Random, tok) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for _ in range(spec.batch):
        if rng.random() < spec.task_fraction:
            p, a = task_line(TASKS[rng.choice(spec.tasks)], rng)
            ids = tok.encode(p + a, bos=True, eos=True)
        else:
            ids = tok.encode(generic_text(rng, rng.randint(*spec.generic_chars)), bos=True, eos=True)
        x, y = _row(ids, 1, spec.max_len, tok.pad_id)
        xs.append(x)
        ys.append(y)
    return torch.tensor(xs), torch.tensor(ys)


def task_batch(spec: FamilySpec, task: str, rng: random.Random, tok) -> tuple[torch.Tensor, torch.Tensor]:
    """One task's examples, loss on the answer and </s> only, padded to the longest row of the batch
    (task rows are short: this roughly halves the fine-tuning time)."""
    rows = []
    for _ in range(spec.batch):
        p, a = task_line(TASKS[task], rng)
        prompt = tok.encode(p, bos=True)
        rows.append((prompt + tok.encode(a, eos=True), len(prompt)))
    width = min(spec.max_len, max(len(ids) for ids, _ in rows))
    xs, ys = zip(*(_row(ids, n, width, tok.pad_id) for ids, n in rows))
    return torch.tensor(xs), torch.tensor(ys)


def _loss(model, x, y):
    logits = model(input_ids=x).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                                             ignore_index=-100)


def _train(model, steps: int, lr: float, batches, warmup: int, cosine: bool, weight_decay: float,
           log=None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(t * torch.pi)).item())

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = _loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (len(losses) % 250 == 0):
            log(f"  step {len(losses)}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f}")
    model.eval()
    return losses


def _save(model, tok, out: Path, meta: dict) -> None:
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save(tmp)
    (tmp / "fidelity.json").write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out)


def _batches(fn, *args):
    while True:
        yield fn(*args)


def build_family(out=DEFAULT_OUT, spec: FamilySpec = FULL, log=print) -> dict:
    """Train (or reuse) ``out/base`` and ``out/<task>`` for every task of the spec; returns their paths."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec_json = json.dumps(asdict(spec), sort_keys=True)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    tok = tokenizer()
    paths = {"base": str(out / "base"), "experts": {t: str(out / t) for t in spec.tasks}}
    timings = {}
    try:
        base_dir = out / "base"
        if base_dir.exists():
            old = json.loads(json.loads((base_dir / "fidelity.json").read_text())["spec"])
            if _base_fields(old) != _base_fields(asdict(spec)):
                raise SystemExit(f"{base_dir} was built with a different spec; remove {out} to rebuild")
        else:
            t0 = time.perf_counter()
            torch.manual_seed(_seed(spec.seed, "init"))
            model = LlamaForCausalLM(llama_config(spec, len(tok)))
            n_params = sum(p.numel() for p in model.parameters())
            rng = random.Random(_seed(spec.seed, "pretrain"))
            losses = _train(model, spec.pretrain_steps, spec.pretrain_lr, _batches(pretrain_batch, spec, rng, tok),
                            warmup=max(1, spec.pretrain_steps // 20), cosine=True, weight_decay=0.01, log=log)
            secs = time.perf_counter() - t0
            _save(model, tok, base_dir, {"role": "base", "spec": spec_json, "params": n_params, "seconds": secs,
                                         "loss_first": losses[0], "loss_last": sum(losses[-20:]) / len(losses[-20:])})
            timings["base"] = secs
            log(f"base: {n_params} params, {spec.pretrain_steps} steps, loss {losses[0]:.3f} -> "
                f"{sum(losses[-20:]) / len(losses[-20:]):.3f}, {secs:.1f}s")
        for task in spec.tasks:
            edir = out / task
            if edir.exists():
                continue
            t0 = time.perf_counter()
            torch.manual_seed(_seed(spec.seed, "expert", task))
            model = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
            rng = random.Random(_seed(spec.seed, "finetune", task))
            losses = _train(model, spec.expert_steps, spec.expert_lr, _batches(task_batch, spec, task, rng, tok),
                            warmup=max(1, spec.expert_steps // 10), cosine=False, weight_decay=0.0)
            secs = time.perf_counter() - t0
            _save(model, tok, edir, {"role": "expert", "task": task, "spec": spec_json, "seconds": secs,
                                     "loss_first": losses[0], "loss_last": sum(losses[-20:]) / len(losses[-20:])})
            timings[task] = secs
            log(f"expert {task}: {spec.expert_steps} steps, loss {losses[0]:.3f} -> "
                f"{sum(losses[-20:]) / len(losses[-20:]):.3f}, {secs:.1f}s")
    finally:
        torch.set_num_threads(saved_threads)
    paths["timings"] = timings
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help=f"family directory (default {DEFAULT_OUT}, or .../mini with --mini)")
    ap.add_argument("--mini", action="store_true", help="the seconds-sized family the tests build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain-steps", type=int)
    ap.add_argument("--expert-steps", type=int)
    args = ap.parse_args(argv)
    spec = MINI if args.mini else FULL
    kw = {"seed": args.seed}
    if args.pretrain_steps:
        kw["pretrain_steps"] = args.pretrain_steps
    if args.expert_steps:
        kw["expert_steps"] = args.expert_steps
    spec = replace(spec, **kw)
    out = Path(args.out) if args.out else (DEFAULT_OUT.with_name("mini") if args.mini else DEFAULT_OUT)
    t0 = time.perf_counter()
    paths = build_family(out, spec)
    print(json.dumps({"out": str(out), "seconds": round(time.perf_counter() - t0, 1), **paths}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
