"""A merge started on another thread than the main one (a dashboard page's run, a server's worker) publishes: the
engine sets its SIGTERM handler only where Python allows it, the main thread, and leaves it alone elsewhere."""

from __future__ import annotations

import signal
import threading

import torch

from dashboard_helpers import build_catalog
from merge_helpers import load_dir
from mergepipe import api


def test_a_merge_on_a_worker_thread_publishes_and_equals_one_on_the_main_thread(tmp_path):
    built = build_catalog(tmp_path / "b", merged=False)
    before = signal.getsignal(signal.SIGTERM)
    errors = []

    def merge(out, model_id):
        cat = api.Catalog(built.db)
        try:
            api.merge(cat, "base", ["expert_1", "expert_2"], out, operator="ties", model_id=model_id, density=0.3,
                      budget="50%")
        except Exception as exc:  # the assertion below names it
            errors.append(repr(exc))
        finally:
            cat.close()

    worker = threading.Thread(target=merge, args=(tmp_path / "thread", "on-thread"))
    worker.start()
    worker.join()
    assert errors == []
    merge(tmp_path / "main", "on-main")
    a, b = load_dir(tmp_path / "thread"), load_dir(tmp_path / "main")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert signal.getsignal(signal.SIGTERM) == before
