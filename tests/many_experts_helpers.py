"""A catalog of many experts (K = 64, tiny shapes, analyzed), for what must stay legible and fast with K = 64:
EXPLAIN's per-expert table, the Plan page's access mask. Built once per session (about 10 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

from mergepipe.analyze.runner import analyze
from mergepipe.catalog.db import Catalog
from mergepipe.catalog.models import register, register_many
from mergepipe.research.family import make_family

K = 64
_CACHE: dict[int, Path] = {}


def many_experts_catalog(tmp_path_factory, k: int = K) -> Path:
    """The path of a session-shared catalog: base + ``k`` tiny fp32 experts e1..ek, analyzed on 64 KiB blocks
    (read-only: copy it to change it)."""
    if k not in _CACHE:
        root = tmp_path_factory.mktemp(f"many-{k}")
        paths = make_family(root / "fam", experts=k, size="tiny", dtype="fp32", seed=3)
        db = root / "catalog.sqlite"
        cat = Catalog(db)
        try:
            register(cat, "base", str(paths["base"]))
            register_many(cat, [(f"e{i}", str(p)) for i, p in enumerate(paths["experts"], 1)], base_id="base")
            analyze(cat, block_bytes=16 << 10)
            cat.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            cat.close()
        _CACHE[k] = db
    return _CACHE[k]


def expert_ids(k: int = K) -> list[str]:
    return [f"e{i}" for i in range(1, k + 1)]
