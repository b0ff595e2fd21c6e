"""engine.prefetch: the warm-up reads are the plan's own first reads, in the engine's order, never more;
a cold merge with the warm-up reads what its plan says (counted from /proc/self/io)."""

from __future__ import annotations

import pytest

from merge_helpers import open_copy, shared_family
from mergepipe import api
from mergepipe.engine.prefetch import first_ranges, start_warm_up
from mergepipe.planner.plan import expand_ranges
from mergepipe.storage.grid import tensor_grid
from mergepipe.storage.registry import open_checkpoint


def planned_ranges(plan) -> set:
    """Every (path, offset, nbytes) the plan reads, built from the plan and the checkpoints directly."""
    base = open_checkpoint(plan["base"]["uri"])
    out = set()
    for info in base.tensors.values():
        out.add((str(base.path_of(info)), info.offset, info.nbytes))
        for e in plan["experts"]:
            ck = open_checkpoint(e["uri"])
            xi = ck.tensors[info.name]
            chosen = set(expand_ranges(plan["access"][e["id"]].get(info.name, [])))
            out |= {(str(ck.path_of(xi)), xi.offset + s.rel_offset, s.nbytes)
                    for s in tensor_grid(info, plan["grid"]["block_bytes"]) if s.index in chosen}
    return out


@pytest.fixture
def catalog(tmp_path_factory, tmp_path):
    fam = shared_family(tmp_path_factory, "tiny-fp32")
    cat = open_copy(fam, tmp_path / "catalog.sqlite")
    yield cat
    cat.close()


def test_all_of_a_merge_plan_is_its_reads_and_nothing_else(catalog):
    plan = api.plan_merge(catalog, "base", ["e1", "e2", "e3"], operator="task_arithmetic", budget="30%")
    ranges = first_ranges(plan, 1 << 40)
    base_dir = str(open_checkpoint(plan["base"]["uri"]).root)
    assert len(ranges) == len(set(ranges))
    assert set(ranges) == planned_ranges(plan)
    expert_bytes = sum(n for p, _, n in ranges if base_dir not in p)
    assert expert_bytes == plan["estimate"]["expert_read"]


def test_a_limit_takes_the_first_tensors_in_file_order(catalog):
    plan = api.plan_merge(catalog, "base", ["e1", "e2"], operator="linear", budget="50%")
    everything = first_ranges(plan, 1 << 40)
    some = first_ranges(plan, 1)
    assert some == everything[:len(some)] and 0 < len(some) < len(everything)
    base = open_checkpoint(plan["base"]["uri"])
    first = min(base.tensors.values(), key=lambda t: (t.file, t.offset))
    assert some[0] == (str(base.path_of(first)), first.offset, first.nbytes)


def test_an_extend_plan_warms_the_snapshot_and_the_planned_blocks(catalog, tmp_path):
    api.merge(catalog, "base", ["e1", "e2"], tmp_path / "p", operator="task_arithmetic", budget="100%")
    plan = api.plan_extend(catalog, api.extend_request("p", "add", "e3", out=tmp_path / "q"))
    ranges = first_ranges(plan, 1 << 40)
    est = plan["estimate"]
    assert sum(n for _, _, n in ranges) == est["snapshot_read"] + est["base_read"] + est["expert_read"]
    assert all(str(tmp_path / "p") in p for p, _, _ in ranges[:1])
    thread = start_warm_up(plan)
    thread.join(30)
    assert not thread.is_alive()


def test_plans_it_does_not_warm(catalog, tmp_path):
    plan = api.plan_merge(catalog, "base", ["e1"], operator="linear", budget="100%")
    plan.data["layout"] = {"tensors": []}  # a `slices:` layout reads other models' tensors
    assert first_ranges(plan, 1 << 40) == []
    plan.data["layout"] = None
    plan.data["tokenizer"] = {"vocab": {"sha256": "x"}}  # re-ordered embedding rows are read whole, in order
    assert first_ranges(plan, 1 << 40) == []
    plan.data["tokenizer"] = None
    plan.data["base"] = {**plan.data["base"], "uri": "s3://bucket/base"}
    assert start_warm_up(plan) is None
