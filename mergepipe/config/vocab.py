"""mergekit's tokenizer settings over models whose vocabularies differ (issue 15 item 4): the output
vocabulary and every model's embedding row sources, as a request's ``tokenizer["vocab"]``.

``tokenizer_source: union | base | <model>`` and the ``tokenizer:`` block (``source``, ``tokens`` with
``source``/``force``, ``pad_to_multiple_of``) build the output vocabulary and each model's re-ordered
embed_tokens/lm_head rows exactly as mergekit 0.1.5 (storage/vocab_union.py). The setting records the
vocabulary's hash, its size, the padded row count, the models whose tokenizers make it and, per model,
the source of every output row (compact), so the plan digest covers them; the engine composes the rows
(engine/vocab.py) and writes the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from mergepipe.catalog.models import is_vocab_tensor
from mergepipe.errors import MergePipeError
from mergepipe.ops.core import get_op
from mergepipe.planner.methods import VOCAB_METHODS
from mergepipe.planner.settings import PRE_LAYER_NAMES
from mergepipe.storage.registry import open_checkpoint
from mergepipe.storage.vocab_union import (MEAN, TokenSetting, build_vocabulary, config_vocab_size, encode_sources,
                                           row_sources, vocab_sha)


class VocabRefusal(Exception):
    """(where, message): what a config asks that MergePipe refuses."""


def vocab_tensors(cat, model_id: str, root: Path) -> dict[str, tuple[tuple, str]]:
    """A model's 2-D embedding/output tensors: name -> (shape, dtype)."""
    if cat.has_model(model_id):
        rows = [(t["name"], tuple(t["shape"]), t["dtype"]) for t in cat.tensors(model_id)]
    else:
        rows = [(n, tuple(t.shape), t.dtype) for n, t in open_checkpoint(root).tensors.items()]
    return {n: (s, d) for n, s, d in rows if is_vocab_tensor(n) and len(s) == 2}


def row_model_order(cfg, ids: dict[str, str], base_id: str) -> list[str]:
    """mergekit's order of the models whose tensors a merge stacks (it fixes the order of the mean rows'
    sums): a `slices:` config's first slice's sources (the embeddings' models), else the config's models
    in order; the base appended when not listed."""
    refs = [s.ref for s in cfg.slices[0].sources] if cfg.slices is not None else [m.ref for m in cfg.models]
    order = []
    for ref in refs:
        mid = ids.get(ref)
        if mid is not None and mid not in order:
            order.append(mid)
    if base_id not in order:
        order.append(base_id)
    return order


def rows_base(cfg, base_id: str) -> str | None:
    """The model whose row mergekit gives a token several models hold but not all: the `base_model`'s
    (PermutedVocabulary's base role); a soup or `slices:` config without one has none (a mean then)."""
    return None if cfg.base is None or cfg.slices_reference else base_id


def _token_settings(cfg, resolve_ref) -> dict[str, TokenSetting]:
    out = {}
    for tok, force, src in cfg.tokenizer_tokens:
        if src is None:
            source = None
        elif isinstance(src, str):
            source = resolve_ref(src, f"tokenizer.tokens.{tok}.source")
        elif src == ("zero",):
            source = ("zero",)
        else:
            source = (resolve_ref(src[0], f"tokenizer.tokens.{tok}.source.model"), src[1])
        out[tok] = TokenSetting(source=source, force=force)
    return out


def vocab_setting(cat, cfg, base_id: str, models: list[tuple[str, Path]], source: str, row_order: list[str],
                  resolve_ref, kinds: dict[str, str]) -> dict:
    """The ``vocab`` entry of a request's tokenizer (``models``: (id, folder) of the base and every
    expert, config order; ``source``: ``union``, ``base`` or a model id; ``resolve_ref``: a model
    reference as written -> its id). Raises VocabRefusal."""
    row_base = rows_base(cfg, base_id)
    if row_base is None and cfg.tokenizer_source == "base":
        raise VocabRefusal("tokenizer_source", "`base` without a `base_model`: mergekit then takes the tokenizer "
                                               "of an arbitrary one of the models (the first of a Python set, "
                                               "another from run to run); name the model (`tokenizer_source: "
                                               "<model>`) or use `union`")
    op = get_op(cfg.method)
    _refuse_unsupported(cfg, op, kinds)
    roots = dict(models)
    tokens = _token_settings(cfg, resolve_ref)
    # without a base_model the reference (config/soup.py) is named by its id: `base` would not plan back
    label = "union" if source == "union" else ("base" if source == base_id and row_base is not None else source)
    vocab, sources = _vocabulary_and_rows(cfg, base_id, roots, label, tokens, row_order, row_base)
    base_t = vocab_tensors(cat, base_id, roots[base_id])
    if not base_t:
        raise VocabRefusal("tokenizer_source", f"{base_id} has no embedding tensor (embed_tokens, lm_head, ...) "
                                               f"to re-order")
    copies = None
    if op.copies:  # each copied embedding tensor re-ordered alone: the first slice's model's, the last slice's
        first, last = (resolve_ref(sl.sources[0].ref, f"{sl.where}.sources[0].model")
                       for sl in (cfg.slices[0], cfg.slices[-1]))
        copies = {name: first if any(p in name for p in PRE_LAYER_NAMES) else last for name in base_t}
        row_order = list(dict.fromkeys(copies.values()))
        sources = {m: row_sources(vocab, [m], None, tokens)[m] for m in row_order}
    else:
        _check_mean_order(cfg, row_order, sources, resolve_ref)
    _check_row_tensors(cat, vocab, row_order, roots, base_t)
    n = len(vocab.vocab)
    return {
        "source": label,
        "sha256": vocab_sha(vocab.vocab), "tokens_n": n, "rows": vocab.rows,
        "pad_to_multiple_of": cfg.pad_to_multiple_of,
        "tokens": [[t, s.force, list(s.source) if isinstance(s.source, tuple) else s.source]
                   for t, s in tokens.items()],
        "models": [[mid, str(root)] for mid, root in models],
        "row_models": row_order,
        "tensors": {name: [vocab.rows, shape[1]] for name, shape in sorted((k, v[0]) for k, v in base_t.items())},
        "sources": {mid: encode_sources(sources[mid]) for mid in row_order},
        **({"copies": copies} if copies else {}),
    }


def _refuse_unsupported(cfg, op, kinds: dict[str, str]) -> None:
    """Refuse what MergePipe does not re-order rows for: passthrough's `tokens:`, the other nonlinear methods,
    a model that is not a full checkpoint."""
    if op.copies and cfg.tokenizer_tokens:
        raise VocabRefusal("tokenizer.tokens", "passthrough re-orders each copied embedding tensor alone (mergekit "
                                               "0.1.5: its model's own rows, zero rows for the tokens it lacks); a "
                                               "`tokens:` block with passthrough is not done by MergePipe")
    if op.nonlinear and not op.copies and op.name not in VOCAB_METHODS:
        raise VocabRefusal("tokenizer_source", f"re-ordering embedding rows to another vocabulary is done for the "
                                               f"task-vector methods (linear, task_arithmetic, ties, dare, ...) and "
                                               f"{', '.join(VOCAB_METHODS)}, not {op.name}")
    for mid, kind in kinds.items():
        if kind != "full":
            raise VocabRefusal("tokenizer_source", f"{mid} is a {kind} checkpoint: re-ordering embedding rows to "
                                                   f"another vocabulary needs every model's own rows (full checkpoints)")


def _vocabulary_and_rows(cfg, base_id: str, roots: dict, label: str, tokens: dict, row_order: list[str],
                         row_base: str | None) -> tuple:
    """(the output vocabulary, every model's row sources), a refusal as a VocabRefusal."""
    try:
        vocab = build_vocabulary(base_id, roots, label, tuple(tokens), cfg.pad_to_multiple_of)
        sources = row_sources(vocab, row_order, row_base, tokens)
    except MergePipeError as exc:
        where = "tokenizer.tokens" if str(exc).startswith("tokenizer.tokens") else "tokenizer_source"
        raise VocabRefusal(where, str(exc).removeprefix("tokenizer.tokens: ")) from None
    return vocab, sources


def _check_row_tensors(cat, vocab, row_order: list[str], roots: dict, base_t: dict) -> None:
    """Each model's embedding tensors have the base's width and dtype, and a row for each of its tokens."""
    for mid in row_order:
        have = vocab_tensors(cat, mid, roots[mid])
        size = config_vocab_size(roots[mid])
        for name, (shape, dtype) in base_t.items():
            got = have.get(name)
            if got is None or got[0][1] != shape[1] or got[1] != dtype:
                raise VocabRefusal("tokenizer_source", f"{mid}'s {name} is {list(got[0]) if got else 'missing'} "
                                                       f"{got[1] if got else ''}, the base's {list(shape)} {dtype}: "
                                                       f"rows are re-ordered between tensors of one width and dtype")
            need = max(vocab.permutations[mid], default=-1) + 1
            if got[0][0] < need:
                raise VocabRefusal("tokenizer_source", f"{mid}'s {name} has {got[0][0]} rows, its tokenizer "
                                                       f"{need} tokens (config.json vocab_size {size})")


def _check_mean_order(cfg, row_order: list[str], sources: dict, resolve_ref) -> None:
    """mergekit sums a mean row in the order of the tensor's models: the first slice's sources for the
    embeddings, the last slice's for lm_head. The plan holds one order (the first slice's), which gives the
    same float32 sums unless a mean over three or more rows is summed in another order."""
    if cfg.slices is None:
        return
    last = [resolve_ref(s.ref, f"{s.where}.model") for s in cfg.slices[-1].sources]
    if [m for m in last if m in row_order] == [m for m in row_order if m in last]:
        return
    if any(src[0] == MEAN and len(src[1]) > 2 for rows in sources.values() for src in rows):
        raise VocabRefusal("tokenizer_source", f"{cfg.slices[-1].where} lists the models in another order than "
                                               f"{cfg.slices[0].where}, and a token's row is the mean of three or "
                                               f"more models' rows, which mergekit sums in each slice's order: list "
                                               f"the sources in one order")


def needs_vocab(cat, models: list[tuple[str, Path]], want: dict, cfg, base_id: str, vocabulary) -> bool:
    """Whether the settings move rows: a model's vocabulary differs from the output's, a token is added
    or forced, the models' embedding rows differ in number, or ``pad_to_multiple_of`` asks for another
    row count than the base's. (Models sharing one vocabulary and one row count keep their rows as they
    are, even when there are more rows than tokens -- padded embeddings, which mergekit would cut to the
    tokenizer's length.)"""
    for mid, root in models:
        if vocabulary(root) != want:
            return True
    if any(tok not in want or force for tok, force, _ in cfg.tokenizer_tokens):
        return True
    roots = dict(models)
    base_rows = {n: s[0] for n, (s, _) in vocab_tensors(cat, base_id, roots[base_id]).items()}
    for mid, root in models:
        if {n: s[0] for n, (s, _) in vocab_tensors(cat, mid, root).items()} != base_rows:
            return True
    pad = cfg.pad_to_multiple_of
    rows = -(-len(want) // pad) * pad if pad else None
    return rows is not None and any(r != rows for r in base_rows.values())
