"""Run one command and report its own resource usage as JSON on the last line of stderr.

The runner (a big process: torch, catalogs) starts this small interpreter, which starts the contender:
Linux's ru_maxrss of a child counts the memory it inherited at fork, so the contender must be forked
from a small process to report its own peak RSS.

    python benchmarks/child.py CMD [ARGS...]
"""
import json
import os
import subprocess
import sys
import time

t0 = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:])
_, status, ru = os.wait4(proc.pid, 0)
wall = time.perf_counter() - t0
print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall_s": wall, "read_bytes": ru.ru_inblock * 512,
                  "write_bytes": ru.ru_oublock * 512, "peak_rss_bytes": ru.ru_maxrss * 1024}), file=sys.stderr)
sys.exit(0)
