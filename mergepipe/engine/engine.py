"""The streaming merge engine: executes a plan block by block and publishes a snapshot atomically.

:class:`Engine` checks the plan's inputs, runs a :class:`~mergepipe.engine.pipeline.MergePipeline`
into a staging directory (reads, block merges on an :class:`~mergepipe.engine.executor.Executor`,
in-order writes of pre-sized shards by mergepipe.storage.writers), then writes the manifest,
publishes the directory and registers the snapshot in one catalog transaction. Blocks of full/delta checkpoints with linear, task arithmetic,
TIES, DARE, breadcrumbs or DELLA are merged by the fused kernels of mergepipe.ops.kernels (no per-expert float32
temporaries, and no torch: engine/threads.py); the rest by the torch path of mergepipe.ops. Memory is bounded by a byte budget on the
input in flight (groups read ahead plus blocks waiting to be merged and written, ``inflight_bytes``),
so it does not grow with K; groups are cut so that each reads at most ``group_read_bytes`` (at least
one block).
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time
from pathlib import Path

from mergepipe.catalog.db import Catalog, now
from mergepipe.catalog.models import check_content_hash, check_unchanged, input_change, register
from mergepipe.catalog.compacts import check_compact_inputs
from mergepipe.catalog.plans import has_plan
from mergepipe.catalog.runs import mark_run_published
from mergepipe.catalog.snapshots import record_snapshot
from mergepipe.engine import threads as torch_threads
from mergepipe.engine.executor import Executor, LocalExecutor, RangeExecutor
from mergepipe.engine.extend import ExtendPipeline, check_parent_present
from mergepipe.engine.pipeline import MergePipeline
from mergepipe.engine.txn import RemoteTransaction, Transaction, check_output_path
from mergepipe.errors import ExecutionError
from mergepipe.manifest.build import Manifest
from mergepipe.manifest.card import CARD_NAME, write_card
from mergepipe.planner.plan import Plan, load_plan
from mergepipe.storage.grid import DEFAULT_BLOCK_BYTES
from mergepipe.storage.paths import check_output
from mergepipe.storage.publish import check_remote_output, is_remote
from mergepipe.version import __version__

DEFAULT_SHARD_BYTES = 2 << 30
GROUP_BYTES = 4 << 20
READAHEAD = 3
# Bytes of input (base + expert buffers) read or being read and not yet merged and written: read-ahead
# and pending blocks stop there, so memory does not grow with K (a group's cost is its base bytes plus
# the expert bytes the plan selects in it; a group is also cut at GROUP_READ_BYTES of such cost).
INFLIGHT_BYTES = 64 << 20
GROUP_READ_BYTES = 16 << 20


class Engine:
    """``Engine(catalog).execute(plan, out=DIR)`` -> ``(snapshot_id, manifest)``."""

    def __init__(self, catalog: Catalog, transaction_manager=None,
                 readahead: int = READAHEAD, group_bytes: int = GROUP_BYTES, threads: int = 1,
                 workers: int | None = None, fused: bool = True, inflight_bytes: int = INFLIGHT_BYTES,
                 group_read_bytes: int = GROUP_READ_BYTES, executor=None):
        self.catalog = catalog
        # Memory bound: input bytes in flight (read ahead or waiting to be merged and written), and the
        # most a group of blocks reads; ``readahead`` caps the number of groups being read ahead.
        self.inflight_bytes = inflight_bytes
        self.group_read_bytes = group_read_bytes
        # Merge blocks with the fused numba kernels where they apply (bit-identical to the torch path).
        self.fused = fused
        # Blocks are merged on a pool of single-threaded workers (one per core by default).
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        # Block-sized kernels gain nothing from intra-op threads, and OpenMP spin-waits collapse when
        # the cores are shared (measured: 14x slower with 2 threads on a loaded 2-core machine).
        self.threads = threads
        self.readahead = readahead
        self.group_bytes = group_bytes
        # What runs the block merges: ``executor(engine) -> Executor``, called once per merge; by default
        # a LocalExecutor (thread pool) of ``workers`` threads with ``threads`` torch threads each. A
        # RangeExecutor (e.g. engine.ray_executor.RayExecutor) instead runs the merge as range tasks.
        self.executor = executor

    def make_executor(self) -> Executor:
        if self.executor is not None:
            return self.executor(self)
        return LocalExecutor(self.workers, self.threads)

    # --- validation ------------------------------------------------------------------------------
    @staticmethod
    def _read_inputs(plan: Plan) -> list[dict]:
        """The models a plan reads: base and experts; for an incremental plan base, parent snapshot and
        the changed expert (the other experts are not read, so they need not exist any more)."""
        return plan.inputs()

    def _check_inputs(self, plan: Plan) -> dict[str, int]:
        """Inputs as planned (fingerprints; content hashes where registered: returns bytes hashed)."""
        hashed = {}
        for inp in self._read_inputs(plan):
            row = self.catalog.model(inp["id"])
            if row["fingerprint"] != inp["fingerprint"]:
                raise ExecutionError(f"{inp['id']} was re-registered since plan {plan.id} was made; plan again")
            check_unchanged(row)
            if row.get("content_hash"):
                hashed[inp["id"]] = check_content_hash(row)
        if (self.catalog.grid_block_bytes(plan.base_id) or DEFAULT_BLOCK_BYTES) != plan.block_bytes:
            raise ExecutionError(f"the block grid of {plan.base_id} changed since plan {plan.id}; plan again")
        check_compact_inputs(self.catalog, plan)
        return hashed

    @staticmethod
    def _check_inputs_after_reads(plan: Plan) -> None:
        """An input rewritten while the merge read it must not be published as planned."""
        for inp in Engine._read_inputs(plan):
            why = input_change(inp)
            if why:
                raise ExecutionError(f"{why} while the merge ran; nothing was published (merge again)")

    def execute(self, plan: Plan | str, out: str | Path | None = None, model_id: str | None = None,
                out_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None, run_id: int | None = None):
        if isinstance(plan, str):
            plan = load_plan(self.catalog, plan)
        if out is None:
            raise ExecutionError("an output directory is required (--out)")
        remote = is_remote(out)
        out = check_remote_output(str(out)) if remote else check_output(out)
        model_id = model_id or (out.rsplit("/", 1)[-1] if remote else out.name)
        if self.catalog.has_model(model_id):
            raise ExecutionError(f"model id {model_id!r} is already registered; choose another --model-id")
        if out_shard_bytes <= 0:
            raise ExecutionError("--out-shard-size must be positive")
        txn = RemoteTransaction(self.catalog, out) if remote else Transaction(self.catalog, out)
        if remote:
            txn.check()
        else:
            check_output_path(out)
        hashed = self._check_inputs(plan)
        from mergepipe.planner.plan import save_plan
        if not has_plan(self.catalog, plan.id):
            save_plan(self.catalog, plan)
        previous = _own_sigterm()
        if previous is not _NOT_OURS and previous in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _raise_interrupt)
        torch_threads.want(self.threads)  # applied if and when this thread uses torch
        result = None
        try:
            staging = txn.begin()
            t0 = time.perf_counter()
            on_shard_closed = txn.file_ready if remote else None  # uploads overlap the merge
            result = self._run(plan, staging, out_shard_bytes, progress, on_shard_closed)
            self._check_inputs_after_reads(plan)
            result["content_hashed"] = hashed
            manifest = self._manifest(plan, result, model_id, out, time.perf_counter() - t0, staging)
            manifest.write(staging)
            txn.publish()
            txn.commit(lambda: self._register(plan, manifest, model_id, out, run_id, result["inflight"]))
        except BaseException:
            txn.abort()
            if result is not None and result.get("inflight"):  # compacts analyzed on the way, never stored
                result["inflight"].discard()
            raise
        finally:
            torch_threads.release()
            if previous is not _NOT_OURS and previous in (signal.SIG_DFL, None):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return manifest.snapshot_id, manifest

    # --- the streaming loop ------------------------------------------------------------------------
    def _run(self, plan: Plan, staging: Path, out_shard_bytes: int, progress, on_shard_closed) -> dict:
        if plan.is_extend:  # an incremental merge reads the parent snapshot (in this process)
            return ExtendPipeline(self, plan, staging, out_shard_bytes, progress, on_shard_closed).run()
        if isinstance(self.executor, RangeExecutor):  # range tasks where the data lives (e.g. on Ray)
            from mergepipe.engine.ranges import RangeMerge  # (its shards are complete only at the end)
            return RangeMerge(self, plan, staging, out_shard_bytes, progress).run(self.executor)
        return MergePipeline(self, plan, staging, out_shard_bytes, progress, on_shard_closed).run()

    # --- manifest and catalog ----------------------------------------------------------------------
    def _manifest(self, plan: Plan, result: dict, model_id: str, out: Path, seconds: float,
                  staging: Path | None = None) -> Manifest:
        outputs = dict(result["outputs"])
        core = {
            "format": "mergepipe.manifest/1",
            "plan_id": plan.id, "plan_digest": plan.digest,
            "operator": plan.operator, "params": plan.params, "seed": plan.seed,
            "strategy": plan.strategy, "grid": plan.grid,
            "inputs": {"base": plan.base, "experts": plan.experts},
            "budget": plan.budget, "full_expert_bytes": plan.full_expert_bytes,
            "estimated": plan.estimated,
            "estimated_by_expert": plan.estimated_by_expert,
            "realized": {"base_read": result["base_read"], "expert_read": sum(result["realized_by_expert"].values()),
                         "compact_read": sum((result.get("compact_read_by_expert") or {}).values()),
                         "output_write": result["output_write"]},
            "realized_by_expert": result["realized_by_expert"],
            "realized_by_tensor": dict(sorted(result["realized_by_tensor"].items())),
            "touched": result["touched"],
            "error_bound": plan.error_bound,
            "outputs": outputs,
            "software": {"mergepipe": __version__, "torch": torch_threads.torch_version()},
            "parents": [_base_parent(plan)]
            + [{"id": e["id"], "role": "expert", "weight": e["weight"]} for e in plan.experts],
        }
        if plan.compact:  # blocks read from the compact tier: which, at which level, and the bytes
            core["compact"] = plan.compact
            core["tiers"] = plan.tiers
            core["realized_compact_by_expert"] = dict(sorted(result["compact_read_by_expert"].items()))
            core["compact_inputs"] = {e: {"sha256": f["sha256"], "nbytes": f["nbytes"]}
                                      for e, f in sorted(plan.compact_files.items())}
        if plan.base_member:  # a model soup: the base (reference) is averaged in
            core["inputs"]["base_member"] = plan.base_member
        # the tokenizer, a `slices:` merge's layout (which input tensor each output tensor is made of), the
        # dtype the float tensors were converted to, a MoE base's layout
        for key in ("tokenizer", "layout", "out_dtype", "moe_layout"):
            if getattr(plan, key):
                core[key] = getattr(plan, key)
        if plan.is_extend:
            core["realized"]["snapshot_read"] = result["snapshot_read"]
            core["extends"] = {k: plan.parent[k] for k in ("snapshot_id", "model_id", "manifest_hash")}
            core["change"] = plan.change
            core["access_bytes"] = plan.access_bytes
            core["parents"].append({"id": plan.parent["model_id"], "role": "extends", "weight": None})
        if result["content_hashed"]:
            core["content_verified"] = {e: {"bytes_hashed": n} for e, n in sorted(result["content_hashed"].items())}
        if result["analysis_read"]:
            core["analyzed_on_the_way"] = {e: {"bytes_read": n} for e, n in sorted(result["analysis_read"].items())}
        if staging is not None:  # the model card, hashed like every output (it follows from the core alone)
            previous = outputs.pop(CARD_NAME, None)  # a README.md copied from the base is replaced
            if previous:
                core["realized"]["output_write"] -= previous["bytes"]
            outputs[CARD_NAME] = write_card(staging, core)
            core["realized"]["output_write"] += outputs[CARD_NAME]["bytes"]
        snapshot_id = "snap-" + os.urandom(6).hex()
        run = {"snapshot_id": snapshot_id, "model_id": model_id, "out": str(out), "created_at": now(),
               "seconds": round(seconds, 4), "timing": {k: round(v, 4) for k, v in result["timing"].items()},
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if result.get("tasks"):  # merged as range tasks (their peak memory is theirs, not in peak_rss_bytes)
            run["range_tasks"] = result["tasks"]
        return Manifest(core, run)

    def _output_base(self, plan: Plan) -> str | None:
        """The merged model is registered against the base, unless a `slices:` layout gave it other tensors
        (a frankenmerge's extra or fewer layers, fused MoE experts) or another dtype: then it is a model of its
        own (no base)."""
        outputs = plan.output_tensor_names
        if plan.out_dtype or (plan.moe_layout or {}).get("layout") == "fused":
            return None
        if outputs is None:
            return plan.base_id
        names = {t["name"] for t in self.catalog.tensors(plan.base_id)}
        return plan.base_id if outputs == names else None

    def _register(self, plan: Plan, manifest: Manifest, model_id: str, out: Path, run_id, inflight=None) -> None:
        if plan.is_extend:  # a `delete` of the parent that committed first wins (engine/extend.py)
            check_parent_present(self.catalog, plan.parent)
        if inflight:
            inflight.store(self.catalog)
        register(self.catalog, model_id, str(out), base_id=self._output_base(plan), snapshot_id=manifest.snapshot_id)
        record_snapshot(self.catalog, manifest.snapshot_id, model_id, plan.id, str(out), manifest.manifest_hash,
                        manifest.run["created_at"], manifest.to_json(), manifest.core["parents"])
        if run_id is not None:
            mark_run_published(self.catalog, run_id, manifest.snapshot_id)



_NOT_OURS = object()  # not the main thread (a dashboard's page run): signal handlers cannot be set there


def _own_sigterm():
    """The SIGTERM handler in place, when this thread may replace it (only the main thread may)."""
    if threading.current_thread() is not threading.main_thread():
        return _NOT_OURS
    return signal.getsignal(signal.SIGTERM)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _base_parent(plan: Plan) -> dict:
    """The base's lineage entry; in a model soup it is averaged in with a weight (the reference model of a
    config without base_model)."""
    member = plan.base_member
    if not member:
        return {"id": plan.base_id, "role": "base", "weight": None}
    return {"id": plan.base_id, "role": "reference" if member.get("reference") else "base",
            "weight": member.get("weight")}
