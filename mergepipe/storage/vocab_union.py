"""mergekit 0.1.5's output vocabulary over models with different vocabularies, and the embedding rows
each model contributes to it (mergekit/tokenizer/build.py and embed.py), kept as row *sources* so
that a model's re-ordered embed_tokens/lm_head can be read block by block.

The output vocabulary (``tokenizer_source: union``): the base's tokenizer, then every other model's
ordinary tokens it lacks in model order, each model's in its own id order (mergekit appends these in
the iteration order of transformers' ``get_vocab()``, a Rust hash map whose order changes from call to
call, so only their set and positions are comparable), then every added token of every
model (first settings win), then the ``tokens:`` the config names. ``tokenizer_source: <model>``: that
model's tokenizer plus ``tokens:``. Each model's row for output token ``t`` is its own row when it has
``t`` (and ``t`` is not forced); otherwise a default row shared by every model: the ``tokens:`` source
(a model's row for that token, another token's row, or zeros), else the one model holding ``t``, else
the base's row, else the mean of the rows of the models holding it (in model order), zeros when none
does. Rows past the vocabulary (``pad_to_multiple_of``) are the mean of that model's other rows.

Used by config/vocab.py (the request's vocabulary setting and row sources, encoded for the plan) and
engine/vocab.py (the composed rows and the tokenizer written with the merge); docs/tokenizer-union.md.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from mergepipe.errors import StorageError
from mergepipe.storage.safetensors import read_json_object
from mergepipe.storage.tokenizer_files import load_auto_tokenizer

OWN = "own"  # the model's own row
ROW = "row"  # (ROW, model, row): another model's (or another token's) row
MEAN = "mean"  # (MEAN, ((model, row), ...))
ZERO = "zero"
PAD = "pad"  # a padding row: the mean of the model's vocabulary rows


@dataclass(frozen=True)
class TokenSetting:
    """One entry of mergekit's ``tokenizer.tokens``: where a token's default row comes from
    (``source``: a model id, ``("zero",)``, or ``(model, token)`` / ``(model, token_id)``) and whether
    it replaces every model's own row (``force``)."""
    source: str | tuple | None = None
    force: bool = False


@dataclass
class UnionVocabulary:
    tokenizer: object  # a transformers tokenizer (fast), written with save()
    vocab: dict[str, int]  # output token -> id
    permutations: dict[str, list[int]]  # model -> its row for each output id (-1: lacks it)
    original_vocabs: dict[str, dict[str, int]]
    rows: int  # output embedding rows (len(vocab), padded)

    def save(self, folder: Path) -> None:
        self.tokenizer.save_pretrained(str(folder), legacy_format=False, safe_serialization=True)


def _auto_tokenizer(root: Path):
    """The fast tokenizer of ``root``, loaded from a checked copy of its files (the allowed roots)."""
    return load_auto_tokenizer(root, use_fast=True)


def config_vocab_size(root: Path) -> int | None:
    """config.json's vocab_size (or its text_config's), as mergekit reads it; None when absent."""
    path = Path(root) / "config.json"
    if not path.is_file():
        return None
    doc = read_json_object(path)  # one StorageError for bad JSON, a non-object, deep nesting
    text = doc.get("text_config")
    size = doc.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _union_tokenizer(base_tok, toks: dict[str, object], sizes: dict[str, int | None]):
    import transformers
    out_vocab: dict[str, int] = {}
    out_added: dict = {}
    for mid, tok in toks.items():
        size = sizes[mid] or tok.vocab_size
        added = tok.added_tokens_decoder
        added_names = {info.content for info in added.values()}
        # in id order: mergekit iterates get_vocab(), a hash map's order that changes from call to call
        for t, idx in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            if idx < size and t not in added_names and t not in out_vocab:
                out_vocab[t] = len(out_vocab)
        for idx, info in added.items():
            if idx < size and info.content not in out_added:
                out_added[info.content] = info
    with tempfile.TemporaryDirectory() as tmp:  # a copy: adding tokens must not change the base's object
        base_tok.save_pretrained(tmp, legacy_format=False, safe_serialization=True)
        res = transformers.AutoTokenizer.from_pretrained(tmp, use_fast=True)
    base_vocab = base_tok.get_vocab()
    for t in out_vocab:
        if t not in out_added and t not in base_vocab:
            res.add_tokens(t)
    for info in out_added.values():
        res.add_tokens(info)
    return res


def build_vocabulary(base: str, roots: dict[str, Path], source: str = "union", add_tokens: tuple = (),
                     pad_to_multiple_of: int | None = None) -> UnionVocabulary:
    """The output vocabulary and each model's permutation (``roots``: model id -> folder, base
    included, in config order; ``source``: ``union``, ``base`` or a model id of ``roots``)."""
    base_tok = _auto_tokenizer(roots[base])
    sizes = {mid: config_vocab_size(root) for mid, root in roots.items()}
    if any(i >= (sizes[base] or len(base_tok.get_vocab())) for i in base_tok.get_vocab().values()):
        raise StorageError(f"{base}: its tokenizer has ids past config.json's vocab_size (unused tokens "
                           f"mergekit strips first), which MergePipe does not do")
    toks = {base: base_tok}
    toks.update({mid: _auto_tokenizer(root) for mid, root in roots.items() if mid != base})
    if source == "union":
        out = _union_tokenizer(base_tok, toks, sizes)
    elif source == "base":
        out = base_tok
    else:
        out = _auto_tokenizer(roots[source])
    have = set(out.get_vocab())
    for t in add_tokens:
        if t not in have:
            out.add_tokens(t)
            have.add(t)
    vocab = dict(out.get_vocab())
    perms = {}
    for mid in roots:
        model_vocab = toks[mid].get_vocab()
        size = sizes[mid] or len(model_vocab)
        perm = [-1] * len(vocab)
        for t, new in vocab.items():
            old = model_vocab.get(t, -1)
            perm[new] = old if old < size else -1
        perms[mid] = perm
    rows = len(vocab)
    if pad_to_multiple_of and rows % pad_to_multiple_of:
        rows = (rows // pad_to_multiple_of + 1) * pad_to_multiple_of
    return UnionVocabulary(out, vocab, perms, {m: dict(t.get_vocab()) for m, t in toks.items()}, rows)


def row_sources(vocab: UnionVocabulary, models: list[str], base: str | None,
                tokens: dict[str, TokenSetting] | None = None) -> dict[str, list[tuple]]:
    """For each of ``models`` (those whose tensor is merged, in order), the source of every output row
    (OWN, ROW, MEAN, ZERO or PAD), as mergekit's PermutedVocabulary fills it."""
    tokens = dict(tokens or {})
    perms = vocab.permutations
    defaults: dict[str, tuple] = {}
    for t, i in vocab.vocab.items():
        cfg = tokens.get(t)
        present = [m for m in models if perms[m][i] >= 0]
        if len(present) == len(models) and not (cfg and cfg.force):
            continue
        if cfg is not None:
            defaults[t] = _configured_row(vocab, t, i, cfg, models)
        elif len(present) == 1:
            defaults[t] = (ROW, present[0], perms[present[0]][i])
        elif not present:
            defaults[t] = (ZERO,)
        elif base in models and perms[base][i] >= 0:
            defaults[t] = (ROW, base, perms[base][i])
        else:
            defaults[t] = (MEAN, tuple((m, perms[m][i]) for m in present))
    out = {}
    by_id = sorted(vocab.vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise StorageError("the output vocabulary's ids are not 0..n-1")
    for m in models:
        src = []
        for t, i in by_id:
            forced = t in tokens and tokens[t].force
            src.append((OWN, perms[m][i]) if perms[m][i] >= 0 and not forced else defaults.get(t, (ZERO,)))
        out[m] = src + [(PAD,)] * (vocab.rows - len(vocab.vocab))
    return out


def _configured_row(vocab: UnionVocabulary, token: str, i: int, cfg: TokenSetting, models: list[str]) -> tuple:
    src = cfg.source
    if src is None:
        raise StorageError(f"tokenizer.tokens: {token!r} has no source")
    if isinstance(src, tuple) and src[0] == ZERO:
        return (ZERO,)
    model = src[0] if isinstance(src, tuple) else src
    if model not in models:
        raise StorageError(f"tokenizer.tokens: {token!r} takes its row from {model}, which is not merged")
    if isinstance(src, tuple):
        row = src[1] if isinstance(src[1], int) else vocab.original_vocabs[model].get(src[1], -1)
    else:
        row = vocab.permutations[model][i]
    if row < 0:
        raise StorageError(f"tokenizer.tokens: {token!r}: {model} has no such token")
    return (ROW, model, row)


ReadRows = Callable[[str, list[int]], np.ndarray]  # (model, row ids) -> those rows of its tensor


def compose_rows(model: str, sources: dict[str, list[tuple]], read_rows: ReadRows, start: int, stop: int,
                 row_shape: tuple, dtype, pad_row: np.ndarray | None = None) -> np.ndarray:
    """Rows ``start:stop`` of ``model``'s re-ordered tensor (rows of ``row_shape``, in ``dtype``: mergekit's
    promotion of the models' dtypes), reading only the rows they come from (``pad_row``: the model's
    padding row, needed when the range reaches past the vocabulary)."""
    wanted = sources[model][start:stop]
    needs: dict[str, set[int]] = {}
    for s in wanted:
        for m, r in _rows_of(model, s):
            needs.setdefault(m, set()).add(r)
    got = {m: dict(zip(sorted(rs), read_rows(m, sorted(rs)))) for m, rs in needs.items()}
    out = np.zeros((len(wanted), *row_shape), dtype=dtype)
    for k, s in enumerate(wanted):
        if s[0] == OWN:
            out[k] = got[model][s[1]]
        elif s[0] == ROW:
            out[k] = got[s[1]][s[2]]
        elif s[0] == MEAN:
            acc = np.zeros(row_shape, dtype=dtype)
            for m, r in s[1]:
                acc = acc + got[m][r]
            out[k] = acc / np.asarray(len(s[1]), dtype=dtype)
        elif s[0] == PAD:
            if pad_row is None:
                raise StorageError("compose_rows: the range reaches the padding rows; give pad_row")
            out[k] = pad_row
    return out


def _rows_of(model: str, s: tuple) -> list[tuple[str, int]]:
    if s[0] == OWN:
        return [(model, s[1])]
    if s[0] == ROW:
        return [(s[1], s[2])]
    if s[0] == MEAN:
        return list(s[1])
    return []


def compose_tensor(model: str, sources: dict[str, list[tuple]], read_rows: ReadRows, n_vocab: int,
                   row_shape: tuple, dtype) -> np.ndarray:
    """The model's whole re-ordered tensor (padding rows: the mean of its vocabulary rows)."""
    body = compose_rows(model, sources, read_rows, 0, n_vocab, row_shape, dtype)
    rows = len(sources[model])
    if rows == n_vocab:
        return body
    pad = body.mean(axis=0, dtype=body.dtype)
    return np.concatenate([body, np.broadcast_to(pad, (rows - n_vocab, *pad.shape))])


def vocab_sha(vocab: dict[str, int]) -> str:
    """sha256 of the output vocabulary (token -> id, canonical JSON): what the plan records and the
    engine checks the tokenizer it writes against."""
    import hashlib
    text = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def encode_sources(sources: list[tuple]) -> list[list]:
    """One model's row sources, compact for a plan: runs of own rows ``["own", out, row, n]``, then
    ``["row", out, model, row]``, ``["mean", out, [[model, row], ...]]``; zero and padding rows are
    left out (decode_sources restores them from the row counts)."""
    out: list[list] = []
    for i, s in enumerate(sources):
        if s[0] == OWN:
            last = out[-1] if out and out[-1][0] == OWN else None
            if last is not None and last[1] + last[3] == i and last[2] + last[3] == s[1]:
                last[3] += 1
            else:
                out.append([OWN, i, s[1], 1])
        elif s[0] == ROW:
            out.append([ROW, i, s[1], s[2]])
        elif s[0] == MEAN:
            out.append([MEAN, i, [[m, r] for m, r in s[1]]])
    return out


def decode_sources(entries: list[list], n_vocab: int, rows: int) -> list[tuple]:
    """The inverse of :func:`encode_sources` (``n_vocab`` tokens, ``rows`` rows with the padding)."""
    out: list[tuple] = [(ZERO,)] * n_vocab + [(PAD,)] * (rows - n_vocab)
    for e in entries:
        if e[0] == OWN:
            for k in range(e[3]):
                out[e[1] + k] = (OWN, e[2] + k)
        elif e[0] == ROW:
            out[e[1]] = (ROW, e[2], e[3])
        elif e[0] == MEAN:
            out[e[1]] = (MEAN, tuple((m, r) for m, r in e[2]))
        else:
            raise StorageError(f"unknown row source {e[0]!r}")
    return out
