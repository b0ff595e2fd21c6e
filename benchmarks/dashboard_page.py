"""Render one dashboard page N times with Streamlit's AppTest in one process and print each run's
seconds (the first run pays imports and empty caches; the later ones are cached loads). For A/B checks
of the server side: run it alternately with PYTHONPATH set to two checkouts, on the same catalog.

    MERGEPIPE_DB=catalog.sqlite PYTHONPATH=TREE .venv/bin/python benchmarks/dashboard_page.py plan 6 budget=60
"""

import os
import sys
import time
from pathlib import Path

from streamlit.testing.v1 import AppTest


def main(argv: list[str]) -> None:
    page, n = argv[0], int(argv[1])
    query = dict(kv.split("=", 1) for kv in argv[2:])
    repo = Path(os.environ.get("PYTHONPATH", Path(__file__).resolve().parent.parent).split(os.pathsep)[0])
    for i in range(n):
        at = AppTest.from_file(str(repo / "app.py"), default_timeout=600)
        for k, v in query.items():
            at.query_params[k] = v
        if page != "home":
            at.switch_page(f"pages/{page}.py")
        t = time.perf_counter()
        at.run()
        print(page, i, round(time.perf_counter() - t, 3), flush=True)
        if at.exception:
            raise SystemExit(f"{page}: {[e.value for e in at.exception]}")


if __name__ == "__main__":
    main(sys.argv[1:])
