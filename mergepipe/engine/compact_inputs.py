"""The compact records a merge reads (storage/compact.py): per expert its compact file, opened at the
first read, and per (tensor, block) where the record lies and the level the plan reads."""

from __future__ import annotations

import threading

from mergepipe.errors import ExecutionError
from mergepipe.planner.plan import Plan, expand_ranges
from mergepipe.storage.compact import CompactBlock, CompactReader, level_bytes


class CompactInputs:
    """The compact records a plan reads: per expert its file (opened at the first read), and per (tensor, block)
    the record's offset, entries and the level read."""

    def __init__(self, plan: Plan):
        core = plan.compact or {}
        files = plan.compact_files
        self.blocks: dict[str, dict] = {}
        self.files = files
        self.readers: dict[str, CompactReader] = {}
        self._lock = threading.Lock()
        for eid, entry in (core.get("experts") or {}).items():
            if eid not in files:
                raise ExecutionError(f"plan {plan.id} reads compact deltas of {eid} but names no compact file; "
                                     f"plan again")
            where = {(t, b): (off, n) for t, bs in files[eid]["blocks"].items() for b, off, n in bs}
            per = self.blocks.setdefault(eid, {})
            for level, tensors in entry["bits"].items():
                for tensor, ranges in tensors.items():
                    for b in expand_ranges(ranges):
                        off, n = where[(tensor, b)]
                        per[(tensor, b)] = (off, n, entry["group"], int(level))

    def nbytes(self, eid: str, tensor: str, block: int) -> int:
        got = self.blocks.get(eid, {}).get((tensor, block))
        return 0 if got is None else level_bytes(got[1], got[2], got[3])

    def read(self, eid: str, tensor: str, block: int) -> CompactBlock | None:
        got = self.blocks.get(eid, {}).get((tensor, block))
        if got is None:
            return None
        off, n, group, level = got
        with self._lock:
            reader = self.readers.get(eid)
            if reader is None:
                reader = self.readers[eid] = CompactReader(self.files[eid]["path"], self.files[eid]["nbytes"])
        return CompactBlock(reader.read(off, level_bytes(n, group, level)), n, group, level)

    def bytes_read(self) -> dict[str, int]:
        return {eid: r.bytes_read for eid, r in self.readers.items()}

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
