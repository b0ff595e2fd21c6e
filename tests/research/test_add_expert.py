"""research.family.add_expert: one more expert for a family on disk equals that expert of a family made
with one more expert (the benchmarks grow a cached family this way)."""

from __future__ import annotations

import hashlib

from mergepipe.research.family import add_expert, make_family


def digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_added_expert_is_the_expert_of_a_larger_family(tmp_path):
    make_family(tmp_path / "small", experts=2, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=5)
    make_family(tmp_path / "large", experts=3, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=5)
    path = add_expert(tmp_path / "small", 3, size="tiny", dtype="bf16", shard_bytes=64 << 10, seed=5)
    assert path == str(tmp_path / "small" / "expert_3")
    assert digests(tmp_path / "small" / "expert_3") == digests(tmp_path / "large" / "expert_3")
    assert digests(tmp_path / "small" / "expert_3") != digests(tmp_path / "small" / "expert_2")
