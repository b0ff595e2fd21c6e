"""Run a command in a measuring subprocess: its exit status, output, wall seconds and peak RSS.

The peak is ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` read by a fresh wrapper process that has
waited for only this one child, so earlier children of the test process (a torch import, a merge) do
not count. The child runs under an address-space limit, so a regression that starts to blow up fails
the test instead of swapping the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WRAPPER = r"""
import json, resource, subprocess, sys, time
limit, timeout, args = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
def cap():
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
t0 = time.perf_counter()
try:
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, preexec_fn=cap)
    rc, out, err = p.returncode, p.stdout, p.stderr
except subprocess.TimeoutExpired as exc:
    rc, out, err = "timeout", "", (exc.stderr or b"").decode(errors="replace")
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": rc, "stdout": out, "stderr": err, "seconds": seconds, "peak": peak}))
"""


@dataclass
class Measured:
    rc: int | str  # "timeout" when it ran past the limit
    stdout: str
    stderr: str
    seconds: float
    peak_mib: float


def measured(args: list[str], timeout: float = 60, address_space: int = 4 << 30, env: dict | None = None) -> Measured:
    """``args`` run once, under ``address_space`` bytes of virtual memory and ``timeout`` seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    wrapper = subprocess.run([sys.executable, "-c", _WRAPPER, str(address_space), str(timeout), *args],
                             capture_output=True, text=True, env=env, timeout=timeout + 60)
    assert wrapper.returncode == 0, wrapper.stderr
    d = json.loads(wrapper.stdout)
    return Measured(d["rc"], d["stdout"], d["stderr"], d["seconds"], d["peak"] / 2**20)


def cli(*args: str) -> list[str]:
    """The command line of ``mergepipe ARGS`` in a subprocess."""
    return [sys.executable, "-m", "mergepipe.cli", *args]


def one_error_line(m: Measured, *needles: str) -> str:
    """The refusal's one line: exit 2, exactly one ``error:`` line on stderr, no traceback."""
    assert m.rc == 2, (m.rc, m.stderr[-2000:])
    lines = m.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), m.stderr[-2000:]
    assert "Traceback" not in m.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
