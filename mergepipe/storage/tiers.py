"""Storage tiers and their transfer cost: what EXPLAIN's estimated transfer time is built from.

The model, per tier (local disk, s3, http -- which includes https and hf):

    seconds = requests x latency / connections  +  bytes / bandwidth

``requests`` is the larger of the number of contiguous runs of planned blocks (the engine coalesces
the blocks of a run into one ranged read) and bytes / ``part_bytes`` (long runs are fetched as parallel
parts of 8 MiB); ``connections`` is how many requests are in flight at once. The parameters are deliberately
plain defaults, not measurements of your link: set ``$MERGEPIPE_TIER_<TIER>`` (TIER = LOCAL, S3 or
HTTP) to ``LATENCY_MS,MB_PER_S`` -- e.g. ``MERGEPIPE_TIER_S3=25,400`` for 25 ms and 400 MB/s.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from mergepipe.errors import StorageError

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


@dataclass(frozen=True)
class Tier:
    name: str
    latency_s: float
    bandwidth: float  # bytes per second
    connections: int = 16
    part_bytes: int = 8 << 20


DEFAULTS = {"local": Tier("local", 0.0002, 2e9, 8), "s3": Tier("s3", 0.03, 100e6), "http": Tier("http", 0.05, 100e6)}


def tier_name(uri: str) -> str:
    m = _SCHEME.match(uri)
    scheme = m[1].lower() if m else "file"
    return {"file": "local", "s3": "s3", "http": "http", "https": "http", "hf": "http"}.get(scheme, scheme)


def tier(name: str) -> Tier:
    base = DEFAULTS.get(name, DEFAULTS["http"])
    raw = os.environ.get(f"MERGEPIPE_TIER_{name.upper()}")
    if not raw:
        return base
    try:
        latency_ms, mb_per_s = (float(x) for x in raw.split(","))
        if latency_ms < 0 or mb_per_s <= 0:
            raise ValueError
    except ValueError:
        raise StorageError(f"$MERGEPIPE_TIER_{name.upper()} must be LATENCY_MS,MB_PER_S (e.g. 25,400); "
                           f"is {raw!r}") from None
    return Tier(name, latency_ms / 1000, mb_per_s * 1e6, base.connections, base.part_bytes)


def transfer_estimate(reads: list[tuple[str, int, int]]) -> dict:
    """Estimated transfer of a merge's reads, given as (uri, bytes, contiguous runs) per input."""
    per: dict[str, dict] = {}
    for uri, nbytes, runs in reads:
        t = tier(tier_name(uri))
        row = per.setdefault(t.name, {"bytes": 0, "requests": 0})
        row["bytes"] += nbytes
        row["requests"] += max(runs, math.ceil(nbytes / t.part_bytes))
    total = 0.0
    for name, row in per.items():
        t = tier(name)
        row["seconds"] = row["requests"] * t.latency_s / t.connections + row["bytes"] / t.bandwidth
        row["latency_ms"], row["mb_per_s"] = t.latency_s * 1000, t.bandwidth / 1e6
        total += row["seconds"]
    return {"tiers": dict(sorted(per.items())), "seconds": total}
