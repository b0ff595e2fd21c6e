"""PEFT LoRA adapters: parse and validate an adapter directory without reading tensor data.

A PEFT LoRA adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` with,
per targeted linear module, ``<prefix>.<module>.lora_A.weight`` (r x in) and ``.lora_B.weight``
(out x r). The delta of the module's weight is ``scale * B @ A`` with ``scale = alpha / r`` (or
``alpha / sqrt(r)`` with ``use_rslora``), ``r`` and ``alpha`` per module after ``rank_pattern`` /
``alpha_pattern``, exactly as PEFT computes it in ``merge_and_unload``. Rows [r0, r1) of that delta
need rows [r0, r1) of B and all of A, which is what lets a budgeted merge read adapter bytes only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from mergepipe.errors import CatalogError
from mergepipe.storage.safetensors import (
    FLOAT_DTYPES, Checkpoint, TensorInfo, _is_text, _kind, _short, expand_path, open_checkpoint,
    read_json_object,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT saves keys as base_model.model.<module>.lora_A.weight (the adapter name is dropped on save).
KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraPair:
    """One targeted weight: base tensor ``target`` gets delta ``scale * B @ A``."""

    target: str
    a: TensorInfo
    b: TensorInfo
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    root: Path
    checkpoint: Checkpoint
    config: dict
    pairs: dict[str, LoraPair]  # base tensor name -> pair


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern/alpha_pattern lookup: a key matches a module name ending in it."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


MAX_NUMBER = 1e15  # r, lora_alpha and the patterns' values: far above any real rank or alpha


def _positive(value) -> bool:
    """A positive, finite number of a sensible size (an int of 5000 digits is refused, not converted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return 0 < value <= MAX_NUMBER
    return math.isfinite(value) and 0 < value <= MAX_NUMBER


def _shown(value) -> str:
    """A number from the file as it is when short, else what it is."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_NUMBER:
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) and abs(value) <= MAX_NUMBER else "too large or not finite"
    return _kind(value) if not isinstance(value, int) or isinstance(value, bool) else "too large"


# A pattern is matched against every module name: refuse what could backtrack for ever (a quantified
# group, as in (a+)+) and anything longer than a module path.
_NESTED_QUANTIFIER = re.compile(r"\)[*+{]")
MAX_PATTERN = 256


def _config(root: Path) -> dict:
    """adapter_config.json, with every field MergePipe reads checked (type and range); a refusal
    names the file and the field and never quotes more than a short name from it."""
    path = root / ADAPTER_CONFIG
    if not path.is_file():
        raise CatalogError(f"{root}: not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    return checked_config(path, read_json_object(path))


def checked_config(path, config: dict) -> dict:
    """An adapter_config.json's object (read from ``path``, local or remote), every field checked."""
    peft_type = config.get("peft_type", "LORA")
    if not isinstance(peft_type, str):
        raise CatalogError(f"{path}: peft_type must be a name (is {_kind(peft_type)})")
    if peft_type.upper() != "LORA":
        raise CatalogError(f"{path}: peft_type {_short(peft_type, 30)[1:-1]} is not supported (only LORA)")
    for flag in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(flag) is not None and not isinstance(config.get(flag), bool):
            raise CatalogError(f"{path}: {flag} must be true or false (is {_kind(config.get(flag))})")
    for flag, why in (("use_dora", "DoRA adapters"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) adapters")):
        if config.get(flag):
            raise CatalogError(f"{path}: {why} are not supported ({flag} is true)")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not _positive(value):
            raise CatalogError(f"{path}: {key} must be a positive number (got {_shown(value)})")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise CatalogError(f"{path}: {key} must be an object of module patterns to numbers (is {_kind(patterns)})")
        for pattern, value in patterns.items():
            where = f"{path}: {key}[{_short(pattern)}]"
            if len(pattern) > MAX_PATTERN or _NESTED_QUANTIFIER.search(pattern):
                raise CatalogError(f"{where}: pattern too long or with a repeated group (refused: it could "
                                   f"take for ever to match)")
            try:
                re.compile(rf"(.*\.)?{pattern}")
            except (re.error, RecursionError, OverflowError, ValueError):
                raise CatalogError(f"{where}: not a valid regular expression") from None
            if not _positive(value):
                raise CatalogError(f"{where} must be a positive number (got {_shown(value)})")
    targets = config.get("target_modules")
    if targets is not None and not _is_text(targets) and not (
            isinstance(targets, list) and all(_is_text(t) for t in targets)):
        raise CatalogError(f"{path}: target_modules must be a name or a list of names (is {_kind(targets)})")
    return config


def open_adapter(uri: str | Path) -> LoraAdapter:
    """Parse an adapter directory: its config and the header of its weights file."""
    root = expand_path(uri)
    if not root.is_dir():
        raise CatalogError(f"{root}: a LoRA adapter must be a directory with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = _config(root)
    weights = root / ADAPTER_WEIGHTS
    if not weights.is_file():
        other = " (found adapter_model.bin: save the adapter with safe_serialization=True)" \
            if (root / "adapter_model.bin").exists() else ""
        raise CatalogError(f"{root}: no {ADAPTER_WEIGHTS}{other}")
    return adapter_of(root, config, open_checkpoint(weights))


def adapter_of(root, config: dict, ckpt: Checkpoint) -> LoraAdapter:
    """The adapter of a checked config and its opened weights file (local or remote)."""
    weights = root / ADAPTER_WEIGHTS
    ckpt.root = root  # files are named relative to the adapter directory
    ckpt.config = config
    halves: dict[str, dict[str, TensorInfo]] = {}
    unsupported = []
    for name, info in ckpt.tensors.items():
        m = KEY.match(name)
        if not m:
            unsupported.append(name)
            continue
        halves.setdefault(m["module"], {})[m["ab"]] = info
    if unsupported:
        shown = ", ".join(_short(n) for n in sorted(unsupported)[:5]) + (f" and {len(unsupported) - 5} more" if len(unsupported) > 5 else "")
        raise CatalogError(f"{weights}: unsupported tensors (only lora_A/lora_B of linear layers; "
                           f"modules_to_save, embedding LoRA and DoRA are not supported): {shown}")
    rslora = bool(config.get("use_rslora"))
    pairs = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise CatalogError(f"{weights}: {_short(module)} has no lora_{missing} weight")
        a, b = ab["A"], ab["B"]
        for t in (a, b):
            if t.dtype not in FLOAT_DTYPES or len(t.shape) != 2:
                raise CatalogError(f"{weights}: {_short(t.name)} must be a 2-D float tensor (is {t.dtype} "
                                   f"{list(t.shape) if len(t.shape) <= 8 else f'{len(t.shape)}-D'})")
        if a.shape[0] != b.shape[1]:
            raise CatalogError(f"{weights}: {_short(module)}: lora_A is {list(a.shape)} but lora_B is {list(b.shape)} "
                               f"(ranks differ)")
        r = a.shape[0]
        r_config = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if r_config != r:
            raise CatalogError(f"{weights}: {_short(module)} has rank {r} but the config says r={r_config}")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        target = module + ".weight"
        pairs[target] = LoraPair(target, a, b, float(scale))
    if not pairs:
        raise CatalogError(f"{weights}: the adapter holds no LoRA weights")
    return LoraAdapter(root, ckpt, config, pairs)


def base_mismatches(adapter: LoraAdapter, base: Checkpoint, limit: int = 20) -> list[str]:
    """Targets the base does not have, or whose shape does not match B @ A."""
    problems = []
    for target, pair in adapter.pairs.items():
        info = base.tensors.get(target)
        if info is None:
            problems.append(f"targets {target}, which the base does not have")
        elif len(info.shape) != 2 or tuple(info.shape) != (pair.b.shape[0], pair.a.shape[1]):
            problems.append(f"{target}: B @ A is {[pair.b.shape[0], pair.a.shape[1]]} but the base tensor is "
                            f"{list(info.shape)}")
        elif info.dtype not in FLOAT_DTYPES:
            problems.append(f"{target}: base tensor is {info.dtype}, not a float type")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more"]
    return problems
