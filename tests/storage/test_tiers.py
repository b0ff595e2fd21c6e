"""The tier cost model behind EXPLAIN's transfer estimate: requests x latency / connections + bytes /
bandwidth per tier, with the parameters settable through $MERGEPIPE_TIER_<TIER>."""

from __future__ import annotations

import pytest

from mergepipe.errors import StorageError
from mergepipe.storage.tiers import tier_name, transfer_estimate


def test_schemes_map_to_tiers():
    assert [tier_name(u) for u in ("/a/b", "file:///a", "s3://b/k", "http://h/x", "https://h/x", "hf://o/m@r")] == \
        ["local", "local", "s3", "http", "http", "http"]


def test_the_estimate_is_latency_per_request_plus_bytes_over_bandwidth(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_TIER_S3", "40,200")  # 40 ms, 200 MB/s
    monkeypatch.setenv("MERGEPIPE_TIER_LOCAL", "0,1000")
    est = transfer_estimate([("/base", 100_000_000, 10), ("s3://b/e1", 20 << 20, 3), ("s3://b/e2", 1000, 7)])
    s3 = est["tiers"]["s3"]
    # e1: 20 MiB in 3 runs -> ceil(20 MiB / 8 MiB) = 3 requests; e2: 7 runs -> 7 requests
    assert s3["requests"] == 10 and s3["bytes"] == (20 << 20) + 1000
    assert s3["seconds"] == pytest.approx(10 * 0.040 / 16 + ((20 << 20) + 1000) / 200e6)
    local = est["tiers"]["local"]
    assert local["requests"] == 12 and local["seconds"] == pytest.approx(100_000_000 / 1e9)
    assert est["seconds"] == pytest.approx(s3["seconds"] + local["seconds"])


def test_a_bad_tier_setting_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("MERGEPIPE_TIER_HTTP", "fast")
    with pytest.raises(StorageError, match=r"^\$MERGEPIPE_TIER_HTTP must be LATENCY_MS,MB_PER_S \(e.g. 25,400\); "
                                           r"is 'fast'$"):
        transfer_estimate([("https://h/m", 1, 1)])
