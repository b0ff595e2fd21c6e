"""The output tokenizer a resolved config asks for (:func:`_tokenizer`, for resolve.prepare): the tokenizer
source's files, the chat template, and the re-ordered vocabulary when the models' vocabularies differ."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from mergepipe.config.references import _Resolver, _location
from mergepipe.config.templates import CHAT_TEMPLATES
from mergepipe.config.vocab import VocabRefusal, needs_vocab, row_model_order, vocab_setting
from mergepipe.errors import brief
from mergepipe.storage.registry import tokenizer_folder
from mergepipe.storage.tokenizer_files import has_tokenizer, read_chat_template, vocabulary
from mergepipe.storage.uris import RemoteRoot


def _files(location: Path | RemoteRoot) -> Path:
    """A local folder with a location's tokenizer files (a remote folder's are fetched: storage/registry.py)."""
    return tokenizer_folder(location) if isinstance(location, RemoteRoot) else location


def _tokenizer(r: _Resolver, base_id: str, base_path: Path | None) -> dict | None:
    """The output tokenizer a config asks for: None (the base's files, as they are), or the tokenizer
    source's folder, a chat template and/or the re-ordered vocabulary (``vocab``, config/vocab.py).

    mergekit builds the output vocabulary (the base's, a model's, or the union of every model's, plus
    ``tokens``), then re-orders each model's embed_tokens/lm_head rows to it, with ``len(vocabulary)``
    rows (padded to ``pad_to_multiple_of``). When every model has the source's vocabulary and the
    embeddings have that many rows, every re-ordering is the identity: MergePipe then merges as it is
    and copies the source's tokenizer files (a union's is the base's). Otherwise the request carries
    the vocabulary and every model's row sources, and the merge writes mergekit's tokenizer."""
    cfg, cat = r.cfg, r.cat
    vocab_asked = cfg.tokenizer_source is not None or cfg.tokenizer_tokens or cfg.pad_to_multiple_of is not None
    if not vocab_asked and cfg.chat_template is None:
        return None
    base_root = base_path or _location(cat.model(base_id)["uri"])
    models, kinds = _merged_models(r, base_id, base_root)
    source = _tokenizer_source(r, base_id, base_root, models)
    out: dict = {}
    if vocab_asked:
        out.update(_vocab_entries(r, base_id, base_root, models, kinds, source))
    if cfg.chat_template is not None:
        template = _chat_template(r, source, models)
        if template is not None:
            out["chat_template"] = template
    return out or None


def _merged_models(r: _Resolver, base_id: str, base_root) -> tuple[list, dict[str, str]]:
    """((id, location) of the base and of every expert but the adapters, in order; id -> kind)."""
    cat = r.cat
    uris = {base_id: base_root}
    for kw in r.out.to_register:
        uris[kw["model_id"]] = _location(kw["uri"])
    models = [(base_id, base_root)]
    kinds = {base_id: "full"}
    for e in r.out.experts:
        mid = e["model"]
        row = cat.model(mid) if cat.has_model(mid) else None
        kinds[mid] = row["kind"] if row is not None else next(
            kw["kind"] for kw in r.out.to_register if kw["model_id"] == mid)
        if kinds[mid] == "lora":
            continue  # an adapter has the base's vocabulary (embedding LoRA is refused)
        models.append((mid, uris.get(mid) or _location(row["uri"])))
    return models, kinds


def _tokenizer_source(r: _Resolver, base_id: str, base_root, models: list) -> tuple:
    """(source id, its location, the location when it is a folder outside the models merged, else None)."""
    cfg, cat = r.cfg, r.cat
    where = "tokenizer_source"
    ref = cfg.tokenizer_source
    source_id, source_root = base_id, base_root
    outside = None  # a tokenizer folder that is not one of the models merged (its files are copied)
    if ref not in (None, "union", "base", cfg.base, base_id):
        outside = _outside_source(r, ref, where, models)
        if outside is not None:
            source_id, source_root = ref, outside
        else:
            source_id = _model_ref(r, ref, where, models)
            source_root = dict(models).get(source_id) or _location(cat.model(source_id)["uri"])
    return source_id, source_root, outside


def _vocab_entries(r: _Resolver, base_id: str, base_root, models: list, kinds: dict[str, str],
                   source: tuple) -> dict:
    """The re-ordered vocabulary (``vocab``) when the models' rows move, and the tokenizer source when it is
    not the base."""
    cfg, cat = r.cfg, r.cat
    where = "tokenizer_source"
    ref = cfg.tokenizer_source
    source_id, source_root, outside = source
    out: dict = {}
    if not has_tokenizer(_files(source_root)):
        r.fail(where, f"{source_id} has no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.txt, ...)")
    want = vocabulary(_files(source_root))
    with_tokenizer = [(m, p) for m, p in models if has_tokenizer(_files(p))]  # mergekit assumes the base's otherwise
    if needs_vocab(cat, with_tokenizer, want, cfg, base_id, lambda p: vocabulary(_files(p))):
        if outside is not None:
            r.fail(where, f"{ref} is not one of the models merged: re-ordering the embedding rows to its "
                          f"vocabulary needs it among the models (or `base` / `union`)")
        row_order = [m for m in row_model_order(cfg, r.out.ids, base_id) if m in kinds]
        try:
            out["vocab"] = vocab_setting(cat, cfg, base_id, models, "union" if ref == "union" else source_id,
                                         row_order, lambda text, w: _model_ref(r, text, w, models), kinds)
        except VocabRefusal as exc:
            r.fail(*exc.args)
    if source_root != base_root:
        out.update({"source": source_id, "source_uri": str(source_root)})
    return out


def _chat_template(r: _Resolver, source: tuple, models: list) -> str | None:
    """The chat template to write: the named one, the text given, or ``auto``'s most common among the models."""
    source_id, source_root, _ = source
    if not has_tokenizer(_files(source_root)):
        r.fail("chat_template", f"the tokenizer source ({source_id}) has no tokenizer files to attach it to")
    template = r.cfg.chat_template
    if template == "auto":  # mergekit: the most common template among the models (none: leave it)
        found = [t.strip() for t in (read_chat_template(_files(root)) for _, root in models) if t]
        template = Counter(found).most_common(1)[0][0] if found else None
    else:
        template = CHAT_TEMPLATES.get(template, template)
    return template


def _outside_source(r: _Resolver, ref: str, where: str, models: list) -> Path | RemoteRoot | None:
    """The location a tokenizer setting names when it is a folder (local or remote) that is not one of the
    models merged; None for a model."""
    if ref in r.out.ids or r.cat.has_model(ref):
        return None
    path = r._path(ref, where)
    if path is None or any(p == path for _, p in models):
        return None
    return path


def _model_ref(r: _Resolver, ref: str, where: str, models: list[tuple[str, Path]]) -> str:
    """The catalog id of a model a tokenizer setting names (a registered id, a path, ``base``)."""
    cat = r.cat
    if ref == "base" or ref == r.cfg.base:
        return r.out.base
    if ref in r.out.ids:
        return r.out.ids[ref]
    if cat.has_model(ref):
        if cat.model(ref)["kind"] == "lora":
            r.fail(where, f"{brief(ref, 200)}: a LoRA adapter has no tokenizer of its own; name the base or a model")
        return ref
    path = r._path(ref, where)
    if path is None:
        r.fail(where, f"{brief(ref, 200)} is neither `base`, `union`, a registered model id nor an existing path")
    found = next((m for m, p in models if p == path), None)
    if found is None:
        r.fail(where, f"{ref} is not one of the models merged")
    return found
