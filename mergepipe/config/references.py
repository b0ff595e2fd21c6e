"""Map a config's model references to catalog models, changing nothing (:class:`_Resolver`, for
resolve.prepare): a registered id is used as is; a path (or a remote URI) is matched to a registered model
by uri and fingerprint, or else noted for registration under an id derived from its name; ``BASE+ADAPTER``
names a PEFT LoRA adapter on the base. :class:`Resolved` holds the outcome.

A reference is, in this order: a catalog id, a local path, then a bare Hugging Face repo id (``org/name``,
``org/name@revision``, ``org/name/subfolder``): its snapshot in the local Hugging Face cache, else
``hf://org/name@<commit>`` read by range requests (:func:`mergepipe.storage.hub_ids.locate`, called from
``_Resolver._path`` only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import check_unchanged, model_ids, models_at
from mergepipe.config.model import ConfigError, ConfigModel, MergekitConfig
from mergepipe.config.parse_values import _exists
from mergepipe.errors import MergePipeError, brief
from mergepipe.planner.request import MergeRequest
from mergepipe.storage.hub_ids import HubLocation, hub_origin, locate, parse_hub_id
from mergepipe.storage.registry import canonical_uri, open_checkpoint, scheme_of
from mergepipe.storage.uris import RemoteRoot, remote_model_name

REMOTE_HINT = "(or a remote URI: s3://bucket/prefix, https://..., hf://org/model@revision)"


# --- resolving references against the catalog ---------------------------------------------------------
@dataclass
class Resolved:
    """A config resolved to catalog ids, plus the registrations and analyses it still needs."""

    config: MergekitConfig
    base: str
    experts: list[dict]  # {"model": id, "weight"?: w, "density"?: d}
    to_register: list[dict] = field(default_factory=list)  # register() keyword arguments, in order
    reused: dict[str, str] = field(default_factory=dict)  # reference as written -> registered id it matched
    tokenizer: dict | None = None  # {"source", "source_uri", "chat_template"}: None = the base's tokenizer
    ids: dict[str, str] = field(default_factory=dict)  # reference as written -> catalog id
    layout: dict | None = None  # a `slices:` config's output layout (config/slices.py)
    method_params: dict | None = None  # a `slices:` config's per-tensor t (None: the config's own)
    base_member: dict | None = None  # a model soup: the base averaged in (MergeRequest.base_member)

    @property
    def pending(self) -> bool:
        return bool(self.to_register)

    def request(self) -> MergeRequest:
        """The merge request this config makes (its models as catalog ids)."""
        c = self.config
        method_params = c.method_params if self.method_params is None else self.method_params
        return MergeRequest.build(self.base, self.experts, c.method, budget=c.budget, target_bound=c.target_bound,
                                  lam=c.lam, normalize=c.normalize, rescale=c.rescale, gamma=c.gamma,
                                  epsilon=c.epsilon, seed=c.seed, strategy=c.strategy, compact=c.compact,
                                  tokenizer=self.tokenizer, out_dtype=c.out_dtype or c.dtype, moe_layout=c.moe_layout,
                                  layout=self.layout, base_member=self.base_member, **method_params)


PathCheck = Callable[[str], Path]


def _default_check(text: str) -> Path:
    return Path(text).expanduser().absolute()


def _location(uri: str) -> Path | RemoteRoot:
    """A catalog URI as the resolver compares locations: a Path, or a remote URI (never a Path: it would
    fold ``//``)."""
    return RemoteRoot(uri) if scheme_of(uri) is not None else Path(uri)


def _known(text: str) -> bool:
    """An existing local path, a remote URI or a Hub repo id (whether it exists is found when it is opened)."""
    return scheme_of(text) is not None or _exists(text) or parse_hub_id(text) is not None


class _Resolver:
    def __init__(self, cat: Catalog, cfg: MergekitConfig, register_paths: bool, check_path: PathCheck | None,
                 reserved_ids):
        self.cat, self.cfg, self.register_paths = cat, cfg, register_paths
        self.check = check_path or _default_check
        self.taken = model_ids(cat) | set(reserved_ids or ())
        self.out = Resolved(cfg, "", [])
        self.views: dict[str, dict[int, int]] = {}  # expert id -> its layer map (sources at other layers)
        self.base_path: Path | None = None
        self.open = open_checkpoint  # how a checkpoint is opened (preflight counts and keeps what it reads)
        self.hubs: dict[str, HubLocation | None] = {}  # reference -> where its repo id was found (None: no id)
        # a model soup without base_model plans against a reference model (config/soup.py)
        self.base_text, self.base_where = (cfg.base, "base_model") if cfg.base is not None else \
            (cfg.models[0].ref, cfg.models[0].where + ".model")

    def fail(self, where: str, message: str):
        raise ConfigError(f"{self.cfg.source}: {where}: {message}")

    def _path(self, text: str, where: str) -> Path | RemoteRoot | None:
        """The absolute path a reference names (a remote URI in canonical form), or None when nothing
        exists there; a remote URI is registered on the fly, as a path is."""
        if scheme_of(text) is not None:
            try:
                return RemoteRoot(canonical_uri(text))
            except MergePipeError as exc:
                self.fail(where, str(exc))
        if not _exists(text):
            return self._hub(text, where)
        p = self.check(text)
        return Path(p).resolve()

    def _hub(self, text: str, where: str) -> Path | RemoteRoot | None:
        """Where a Hub repo id is read from: its snapshot in the local Hugging Face cache (a local folder), else
        its ``hf://`` URI at the revision's commit; None when ``text`` is no repo id (storage/hub_ids.py)."""
        if text not in self.hubs:
            try:
                self.hubs[text] = locate(text)
            except MergePipeError as exc:
                self.fail(where, str(exc))
        found = self.hubs[text]
        if found is None:
            return None
        return Path(found.uri).resolve() if found.cached else RemoteRoot(canonical_uri(found.uri))

    def _open(self, path: Path | RemoteRoot, text: str, where: str):
        """Open the checkpoint a reference names: a clear error now if it is not one (a repo id's says so)."""
        try:
            return self.open(path)
        except MergePipeError as exc:
            if self.hubs.get(text) is None:
                raise
            self.fail(where, f"{text} is not a local path; as a Hugging Face repo id ({path}): {exc}")

    def _derive_id(self, path: Path | RemoteRoot) -> str:
        origin = hub_origin(str(path))
        if isinstance(path, RemoteRoot):
            name = remote_model_name(path)
        elif origin is not None:  # a snapshot in the Hugging Face cache: the repo's name, as for hf://
            name = origin.name
        else:
            name = path.name if path.is_dir() else path.stem
        name = name or "model"
        cand, n = name, 2
        while cand in self.taken:
            cand, n = f"{name}-{n}", n + 1
        self.taken.add(cand)
        return cand

    def _rows_at(self, path: Path) -> list[dict]:
        return models_at(self.cat, str(path))

    def _unregistered(self, where: str, text: str):
        self.fail(where, f"{text} is not registered in the catalog; register and analyze it first "
                         f"(Models page, or `mergepipe merge --config` which does it for you)")

    def base(self) -> tuple[str, Path | None]:
        text, where = self.base_text, self.base_where
        if self.cat.has_model(text):
            return text, _location(self.cat.model(text)["uri"])
        path = self._path(text, where)
        if path is None:
            if self.split_lora(text):
                self.fail(where, "a LoRA-patched model (BASE+ADAPTER) cannot be the base; "
                                 "list the adapter under `models:`")
            self.fail(where, f"{brief(text, 200)} is neither a registered model id nor an existing path {REMOTE_HINT}")
        rows = [r for r in self._rows_at(path) if r["kind"] == "full"]
        rows.sort(key=lambda r: r["base_id"] is not None)  # a plain base first
        for row in rows:
            check_unchanged(row)
            self.out.reused[text] = row["id"]
            return row["id"], path
        if not self.register_paths:
            self._unregistered(where, text)
        self._open(path, text, where)  # a clear error now if it is not a checkpoint
        mid = self._derive_id(path)
        self.out.to_register.append({"model_id": mid, "uri": str(path), "base_id": None, "kind": "full"})
        return mid, path

    def split_lora(self, text: str) -> tuple[str, str] | None:
        """``BASE+ADAPTER`` -> (base reference, adapter path) when both sides exist."""
        if self.cat.has_model(text) or _exists(text):
            return None
        for i, ch in enumerate(text):
            if ch == "+":
                left, right = text[:i], text[i + 1:]
                if left and right and (self.cat.has_model(left) or _known(left)) and _known(right):
                    return left, right
        return None

    def expert(self, m: ConfigModel, base_id: str, base_path: Path | None) -> str | None:
        """The catalog id of one model (None: it is the base itself, which mergekit skips)."""
        text, where = m.ref, m.where + ".model"
        if self.cat.has_model(text):
            if text == base_id:
                return None
            return text
        lora = self.split_lora(text)
        kind = "lora" if lora else "full"
        if lora:
            left, right = lora
            same_base = left == base_id or (base_path is not None and not self.cat.has_model(left)
                                            and self._path(left, where) == base_path)
            if not same_base:
                self.fail(where, f"the adapter {right} is applied to {left}, but the merge base is "
                                 f"{self.base_text}: MergePipe merges adapters trained on the merge base")
            path = self._path(right, where)
        else:
            path = self._path(text, where)
            if path is None:
                self.fail(where, f"{brief(text, 200)} is neither a registered model id nor an existing path {REMOTE_HINT}")
            if base_path is not None and path == base_path:
                return None
        rows = [r for r in self._rows_at(path) if r["base_id"] == base_id
                and (r["kind"] == "lora" if lora else r["kind"] != "lora")]
        if rows:
            row = rows[0]
            check_unchanged(row)
            self.out.reused[text] = row["id"]
            mid = row["id"]
        else:
            if not self.register_paths:
                self._unregistered(where, text)
            if not lora:
                self._open(path, text, where)  # a clear error now if it is not a checkpoint
            mid = self._derive_id(path)
            self.out.to_register.append({"model_id": mid, "uri": str(path), "base_id": base_id, "kind": kind})
        return mid
