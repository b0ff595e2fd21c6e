"""The I/O floor of a plan: read exactly the bytes the budgeted merge must read (all of the base, the
selected expert blocks), with no arithmetic, then write and fsync an output of the same size.

    python benchmarks/floor.py PLAN.json OUT_FILE
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergepipe.storage.grid import tensor_grid  # noqa: E402
from mergepipe.planner.plan import expand_ranges  # noqa: E402
from mergepipe.storage.local import RangeReader  # noqa: E402
from mergepipe.storage.safetensors import open_checkpoint

CHUNK = 16 << 20


def main(plan_path: str, out_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    base = open_checkpoint(plan["base"]["uri"])
    total = 0
    buf = bytearray(CHUNK)
    for f in base.files:  # sequential read of the whole base
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := os.readv(fd, [buf]):
            total += n
        os.close(fd)
    bb = plan["grid"]["block_bytes"]
    for e in plan["experts"]:
        ck = open_checkpoint(e["uri"])
        with RangeReader(ck) as r:
            ranges = []
            for tname, rs in plan["access"][e["id"]].items():
                info = ck.tensors[tname]
                spans = tensor_grid(info, bb)
                ranges += [(info.file, info.offset + spans[i].rel_offset, spans[i].nbytes) for i in expand_ranges(rs)]
            ranges.sort()
            for i in range(0, len(ranges), 64):
                r.read_ranges(ranges[i:i + 64])
            total += r.bytes_read
    size = sum(t.nbytes for t in base.tensors.values())
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    zeros = bytes(CHUNK)
    left = size
    while left:
        left -= os.write(fd, zeros[: min(CHUNK, left)])
    os.fsync(fd)
    os.close(fd)
    print(json.dumps({"read": total, "written": size}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
