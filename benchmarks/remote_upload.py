"""Remote output: one merged snapshot published to an s3:// prefix, the serial code vs the parallel one.

A family is merged once on local disk; that snapshot folder is then published (``RemoteOutput.stage``
then ``publish``: uploads to the staging prefix, server-side copies, the manifest last, staging objects
deleted) to moto's S3 server through tests/remote_helpers.py's logging S3Proxy, each its own process on
127.0.0.1. "serial" is publish.py as it was before the parallel publish (read from git at --serial-ref),
"parallel" is the working tree's; they alternate, each round publishing to a fresh prefix. Every
published prefix is checked to hold the snapshot's files at their sizes, then emptied. Run once with the
proxy adding no latency (loopback: CPU-bound on client, proxy and moto alike) and once holding every PUT
50 ms (request latency of a real store).

    python benchmarks/remote_upload.py            # medium fp32 family, K = 2, 32 MiB output shards, 3 rounds
    python benchmarks/remote_upload.py --rounds 5 --put-delay-ms 0 20 100 --size small

Prints a markdown table; writes remote-upload.json to --out (default docs/benchmarks).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MB = 1e6
SERIAL_REF = "1544afb"  # main before the parallel publish

PROXY = """
import sys, time
sys.path.insert(0, {tests!r})
from remote_helpers import S3Proxy
with S3Proxy({upstream!r}) as proxy:
    proxy.put_delay = {delay!r}
    print(proxy.url, flush=True)
    while True:
        time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def start_servers(put_delay: float = 0.0) -> tuple[list[subprocess.Popen], str]:
    """moto's S3 server and the proxy in front of it (holding each PUT ``put_delay`` s), each its own
    process; the proxy's URL."""
    port = free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port)
    code = PROXY.format(tests=str(ROOT / "tests"), upstream=f"http://127.0.0.1:{port}", delay=put_delay)
    proxy = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return [moto, proxy], proxy.stdout.readline().strip()


def serial_module(ref: str, work: Path):
    """publish.py as it was at ``ref`` (one upload, then one copy, at a time)."""
    source = subprocess.run(["git", "show", f"{ref}:mergepipe/storage/publish.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = work / "publish_serial.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("publish_serial", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def merged_snapshot(work: Path, size: str, dtype: str, shard_bytes: int) -> Path:
    from mergepipe.api import merge
    from mergepipe.catalog.db import Catalog
    from mergepipe.catalog.models import register, register_many
    from mergepipe.research.family import make_family

    fam = make_family(work / "fam", experts=2, size=size, dtype=dtype, seed=3)
    cat = Catalog(work / "c.sqlite")
    register(cat, "base", fam["base"])
    register_many(cat, [(f"e{i}", e) for i, e in enumerate(fam["experts"], 1)], base_id="base")
    merge(cat, "base", ["e1", "e2"], work / "merged", "linear", out_shard_bytes=shard_bytes)
    cat.close()
    return work / "merged"


def publish_once(module, folder: Path, uri: str) -> dict:
    out = module.RemoteOutput(uri, "txn-" + uuid.uuid4().hex[:16])
    t0 = time.perf_counter()
    out.stage(folder)
    t1 = time.perf_counter()
    out.publish(folder)
    t2 = time.perf_counter()
    return {"upload_s": t1 - t0, "copy_manifest_s": t2 - t1, "total_s": t2 - t0}


def check_and_empty(fs, prefix: str, folder: Path) -> None:
    found = {p[len(prefix) + 1:]: info["size"] for p, info in fs.find(prefix, detail=True).items()}
    local = {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    if found != local:
        raise RuntimeError(f"{prefix}: published {sorted(found)} != {sorted(local)}")
    fs.rm(list(fs.find(prefix)))


def measure(folder: Path, contenders: dict, rounds: int, put_delay: float) -> dict[str, list[dict]]:
    """Alternating rounds of every contender publishing ``folder`` through a fresh moto and proxy."""
    servers, url = start_servers(put_delay)
    os.environ.update({"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        import s3fs
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
        fs.mkdir("out")
        runs: dict[str, list[dict]] = {k: [] for k in contenders}
        for r in range(rounds):
            for label in (list(contenders) if r % 2 == 0 else list(reversed(contenders))):
                prefix = f"out/{label}-{r}"
                runs[label].append(publish_once(contenders[label], folder, f"s3://{prefix}"))
                check_and_empty(fs, prefix, folder)
        return runs
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--shard-mb", type=int, default=32, help="output shard size in MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--put-delay-ms", type=float, nargs="+", default=[0, 50],
                    help="the proxy holds every PUT (upload or copy) this long: request latency")
    ap.add_argument("--serial-ref", default=SERIAL_REF)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args()

    from mergepipe.storage import publish as parallel
    work = Path(tempfile.mkdtemp(prefix="remote-upload-"))
    try:
        folder = merged_snapshot(work, args.size, args.dtype, args.shard_mb << 20)
        sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()]
        contenders = {"serial": serial_module(args.serial_ref, work), "parallel": parallel}
        results = {ms: measure(folder, contenders, args.rounds, ms / 1000) for ms in args.put_delay_ms}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, results, sum(sizes), len(sizes))


def report(args, results: dict, total: int, n_files: int) -> None:
    print(f"{args.size} {args.dtype} family, K = 2, linear: {n_files} files, {total / MB:.1f} MB; "
          f"median of {args.rounds} rounds (alternating order), {os.cpu_count()} CPUs\n")
    print("| PUT latency | publish | upload s | copies + manifest s | total s | MB/s | vs serial |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    medians = {}
    for ms, runs in results.items():
        med = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in runs.items()}
        medians[ms] = med
        for k, m in med.items():
            print(f"| {ms:g} ms | {k} | {m['upload_s']:.2f} | {m['copy_manifest_s']:.2f} | {m['total_s']:.2f} | "
                  f"{total / MB / m['total_s']:.1f} | {med['serial']['total_s'] / m['total_s']:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "remote-upload.json").write_text(json.dumps(
        {"size": args.size, "dtype": args.dtype, "shard_mb": args.shard_mb, "files": n_files, "bytes": total,
         "cpus": os.cpu_count(), "runs": {str(k): v for k, v in results.items()},
         "median": {str(k): v for k, v in medians.items()}}, indent=2))


if __name__ == "__main__":
    main()
