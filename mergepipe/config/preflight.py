"""Preflight: what merging a config will meet, found before a single weight byte moves.

Every model is resolved as a merge resolves it (config/references.py: catalog id, local path, the local
Hugging Face cache, ``hf://`` range reads) and opened: its index, safetensors headers and config.json only
(range requests for a remote model, the files of a local one or of a cached Hub snapshot). Each is compared
with the base:

* tensor names, shapes and dtypes that differ from the base's (MergePipe refuses them);
* vocabulary sizes (the rows of the embedding) and what the tokenizer settings do with them;
* tied embeddings: ``tie_word_embeddings`` and an output head (``lm_head``) present in some inputs and not in
  others;

and config/preflight_estimate.py adds what the output will contain (the base's tensors: its parameter count,
any growth of the embedding flagged), the bytes to read and to transfer (the full merge, exact from the
headers, and under the budget), a peak memory estimate and the time the tier cost model gives.

:func:`preflight` returns a :class:`Preflight`; ``problems`` are what would stop the merge, one line each
(none: the merge will run), ``transferred`` the bytes preflight itself moved over the network."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.mismatch import vocab_size
from mergepipe.catalog.models import layout_mismatches
from mergepipe.config.model import ConfigModel, MergekitConfig
from mergepipe.config.preflight_estimate import HEADS, tie_setting, estimate, heads, output_of
from mergepipe.config.references import PathCheck, _Resolver
from mergepipe.errors import MergePipeError
from mergepipe.storage.hub_ids import transferred
from mergepipe.storage.lora import base_mismatches
from mergepipe.storage.registry import open_adapter, scheme_of
from mergepipe.storage.tokenizer_files import has_tokenizer

LIST_AT_MOST = 3  # layout differences named per model (the count says how many in all)


@dataclass
class Input:
    """One model of the config as preflight found it."""

    ref: str  # as written
    where: str  # base_model, models[1].model
    role: str  # base, model, adapter
    source: str = ""  # catalog, local, Hugging Face cache @sha, Hub range reads @sha, s3, http
    uri: str | None = None
    kind: str = "full"
    ckpt: object = None  # the Checkpoint (an adapter's weights for a LoRA)
    adapter: object = None
    fetched: int = 0  # bytes moved over the network to open it
    error: str | None = None
    differences: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.where} {self.ref}"


@dataclass
class Preflight:
    """The outcome: ``inputs`` (base first), ``problems`` (one line each), ``notes``, ``output``, ``estimate``
    (preflight_estimate.py) and ``transferred`` (bytes preflight moved: headers, indexes and configs)."""

    source: str
    method: str
    inputs: list[Input]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    output: dict = field(default_factory=dict)
    estimate: dict = field(default_factory=dict)
    transferred: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def resolved(self) -> bool:
        """Every model was found and opened (a refusal is then about the models themselves)."""
        return all(i.error is None for i in self.inputs)


def _memo_open(r: _Resolver, opened: dict):
    """An opener for the resolver that keeps what it opened, so that each checkpoint is read once."""
    first = r.open

    def open_once(path):
        key = str(path)
        if key not in opened:
            opened[key] = first(path)
        return opened[key]
    return open_once


def _source(r: _Resolver, text: str, uri: str, registered: bool) -> str:
    hub = r.hubs.get(text)
    scheme = scheme_of(uri)
    how = hub.how if hub is not None else f"{scheme}://" if scheme else "local"
    return f"catalog, {how}" if registered else how


def _locate(r: _Resolver, inp: Input, mid: str | None, base_uri: str | None) -> None:
    """Fill in where a resolved model lives (catalog row or pending registration) and open it."""
    if mid is None:  # the base listed among the models: mergekit skips it
        inp.uri, inp.role, inp.source = base_uri, "base (again)", "the base"
        return
    pending = {kw["model_id"]: kw for kw in r.out.to_register}
    row = pending.get(mid) or r.cat.model(mid)
    inp.uri, inp.kind = str(row["uri"]), row["kind"]
    inp.source = _source(r, inp.ref.split("+")[-1] if inp.kind == "lora" else inp.ref, inp.uri, mid not in pending)
    if inp.kind == "lora":
        inp.role = "adapter"
        inp.adapter = open_adapter(inp.uri)
        inp.ckpt = inp.adapter.checkpoint
    else:
        inp.ckpt = r.open(inp.uri)


def _resolve(r: _Resolver, cfg: MergekitConfig) -> list[Input]:
    """The base and every model, each resolved and opened, or with the error that stopped it."""
    base = Input(r.base_text, r.base_where, "base")
    inputs = [base]
    before = transferred()
    try:
        base_id, base_path = r.base()
        r.out.base, r.base_path = base_id, base_path
        _locate(r, base, base_id, None)
    except MergePipeError as exc:
        base.error = str(exc)
        base.fetched = transferred() - before
        return inputs
    base.fetched = transferred() - before
    models = cfg.models[1:] if cfg.base is None else cfg.models
    for m in models:
        inputs.append(_resolve_model(r, m, base_id, base_path, base.uri))
    return inputs


def _resolve_model(r: _Resolver, m: ConfigModel, base_id: str, base_path, base_uri: str) -> Input:
    inp = Input(m.ref, m.where + ".model", "model")
    before = transferred()
    try:
        mid = r.expert(m, base_id, base_path)
        _locate(r, inp, mid, base_uri)
    except MergePipeError as exc:
        inp.error = str(exc)
    inp.fetched = transferred() - before
    return inp


# --- comparisons with the base ---------------------------------------------------------------------------
def _head_problem(inp: Input, base: Input) -> str | None:
    """An output head present in this model and not in the base, or the other way round."""
    mine, theirs = heads(inp.ckpt), heads(base.ckpt)
    if mine and not theirs:
        t = inp.ckpt.tensors[mine[0]]
        n = 1
        for d in t.shape:
            n *= d
        return (f"{inp.label}: has its own {mine[0]} {list(t.shape)} but the base ties its embeddings (no "
                f"{mine[0]}{tie_setting(base.ckpt)}): an output with it would gain {n:,} parameters; MergePipe keeps "
                f"the base's tensors and refuses the extra one (merge onto a base with an untied {mine[0]}, or "
                f"drop it)")
    if theirs and not mine:
        return (f"{inp.label}: ties its embeddings (no {theirs[0]}{tie_setting(inp.ckpt)}) but the base has one: "
                f"there is no {theirs[0]} of this model to merge (MergePipe refuses a missing tensor); untie it (save "
                f"{theirs[0]} as a copy of the embedding) or use a tied base")
    return None


def _vocab_problem(inp: Input, base: Input, cfg: MergekitConfig, notes: list[str]) -> str | None:
    """Another vocabulary size than the base's: what the tokenizer settings do with it (or why they cannot)."""
    mine, theirs = vocab_size(inp.ckpt), vocab_size(base.ckpt)
    if mine is None or theirs is None or mine == theirs or inp.kind == "lora":
        return None
    head = f"{inp.label}: vocabulary of {mine:,} rows != the base's {theirs:,}"
    local = scheme_of(inp.uri) is None and has_tokenizer(Path(inp.uri))
    if not local:
        return (f"{head}; re-ordering its embedding rows needs its tokenizer files on local disk (a remote model: "
                f"download it once into the Hugging Face cache, then name it by its repo id)")
    if cfg.tokenizer_source is None:
        return (f"{head}; without `tokenizer_source` the output keeps the base's tokenizer and rows: set "
                f"`tokenizer_source: union` (or `base`) to re-order every model's embedding rows to one tokenizer")
    notes.append(f"{head}: its embedding rows are re-ordered to the {cfg.tokenizer_source} vocabulary "
                 f"(tokenizer_source: {cfg.tokenizer_source})")
    return None


def _layout_problem(inp: Input, base: Input) -> str | None:
    """Tensor names, shapes and dtypes that differ from the base's (vocabulary rows and heads said apart)."""
    if inp.kind == "lora":
        found = base_mismatches(inp.adapter, base.ckpt, limit=10 ** 9)
    else:
        found = [p for p in layout_mismatches(base.ckpt, inp.ckpt, limit=None, vocab_rows=True)
                 if not (p.endswith(HEADS) and p.startswith(("missing tensor", "extra tensor")))]
    inp.differences = found
    if not found:
        return None
    shown = "; ".join(found[:LIST_AT_MOST]) + (f"; ... {len(found)} differences in all" if len(found) > LIST_AT_MOST
                                              else "")
    return f"{inp.label}: does not match the base: {shown}"


def compare(cfg: MergekitConfig, inputs: list[Input]) -> tuple[list[str], list[str]]:
    """(problems, notes) of every model against the base."""
    problems, notes = [], []
    base = inputs[0]
    for inp in inputs:
        if inp.error is not None:
            problems.append(inp.error)
    if base.ckpt is None:
        return problems, notes
    if cfg.slices is not None or cfg.modules is not None:
        notes.append("a `slices:`/`modules:` config: layouts are compared per slice when the merge expands it")
        return problems, notes
    for inp in inputs[1:]:
        if inp.ckpt is None or inp.role == "base (again)":
            continue
        for check in (_layout_problem(inp, base), inp.kind != "lora" and _head_problem(inp, base),
                      _vocab_problem(inp, base, cfg, notes)):
            if check:
                problems.append(check)
    return problems, notes


def preflight(cat: Catalog, cfg: MergekitConfig, check_path: PathCheck | None = None) -> Preflight:
    """Resolve and open every model of ``cfg`` (headers only) and say what its merge will meet; changes nothing
    stored (the catalog is only read)."""
    start = transferred()
    r = _Resolver(cat, cfg, True, check_path, ())
    r.open = _memo_open(r, {})
    inputs = _resolve(r, cfg)
    problems, notes = compare(cfg, inputs)
    out = Preflight(cfg.source, cfg.method, inputs, problems, notes)
    if inputs[0].ckpt is not None:
        out.output = output_of(cfg, inputs, notes)
        out.estimate = estimate(cfg, inputs)
    out.transferred = transferred() - start
    return out
