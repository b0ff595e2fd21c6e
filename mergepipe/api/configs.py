"""mergekit YAML configs: planning and merging one, reading and resolving one for the dashboard, a plan
written back as YAML, and task suites."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mergepipe.api.merging import check_target, execute
from mergepipe.catalog.db import Catalog
from mergepipe.errors import MergePipeError

if TYPE_CHECKING:
    from mergepipe.config.model import MergekitConfig
    from mergepipe.planner.plan import Plan


def _config(config) -> MergekitConfig:
    from mergepipe.config.model import MergekitConfig
    from mergepipe.config.parse import load_config
    return config if isinstance(config, MergekitConfig) else load_config(config)


def plan_config(catalog: Catalog, config, save: bool = True, **overrides) -> Plan:
    """Plan a mergekit config (a path or a parsed :class:`MergekitConfig`); ``overrides`` as in
    ``MergekitConfig.with_overrides``. Paths in it are registered on the fly (and analyzed by the merge)."""
    from mergepipe.config.resolve import plan_from_config
    cfg = _config(config).with_overrides(**overrides)
    return plan_from_config(catalog, cfg, save=save)[0]


def merge_config(catalog: Catalog, config, out, model_id: str | None = None,
                 out_shard_bytes: int | None = None, progress=None, **overrides):
    """Plan and execute a mergekit config; returns (plan, snapshot_id, manifest).

    A config that cannot be merged (bad key, missing path, taken output) changes nothing in the catalog."""
    from mergepipe.config.resolve import plan_from_config
    cfg = _config(config).with_overrides(**overrides)
    out, model_id = check_target(catalog, out, model_id)
    plan, _ = plan_from_config(catalog, cfg, save=False, reserved_ids={model_id})
    snapshot_id, manifest = execute(catalog, plan, out, model_id, out_shard_bytes, progress)
    return plan, snapshot_id, manifest


def read_config_file(path: Path) -> bytes:
    """The bytes of a mergekit YAML file (a regular file no larger than a merge config may be)."""
    from mergepipe.config.model import MAX_CONFIG_BYTES
    from mergepipe.storage.paths import read_regular
    p = Path(path)
    if not p.is_file():
        raise MergePipeError(f"{p} is not a file")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise MergePipeError(f"{p}: {p.stat().st_size} bytes is too large for a merge config")
    return read_regular(p, MAX_CONFIG_BYTES)


def resolve_config(catalog: Catalog, config, register_paths: bool = False, check_path=None):
    """A parsed mergekit config resolved against the catalog (config/resolve.py prepare: base, experts,
    layout); with ``register_paths=False`` every model must be registered already."""
    from mergepipe.config.resolve import prepare
    return prepare(catalog, config, register_paths=register_paths, check_path=check_path)


def plan_as_yaml(catalog: Catalog, plan) -> str:
    """The mergekit YAML (with the ``mergepipe:`` key) of a plan or its data, saved or not."""
    from mergepipe.config.export import export_plan_data
    return export_plan_data(catalog, plan.data if hasattr(plan, "data") else plan)


def read_task_suite(path):
    """A task suite file read and checked (config/task_suite.py); a MergePipeError says what is wrong."""
    from mergepipe.config.task_suite import read_task_suite as _read
    return _read(path)
