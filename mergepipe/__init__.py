"""MergePipe: budget-aware parameter management for weight-space model merging.

Catalog -> Plan -> Execute -> Manifest. The library never imports Streamlit.

    from mergepipe import Catalog, Planner, Engine
"""

from mergepipe.version import __version__  # noqa: E402

from mergepipe.catalog.db import Catalog  # noqa: E402
from mergepipe.errors import MergePipeError  # noqa: E402

__all__ = ["Catalog", "Planner", "Engine", "MergePipeError", "__version__"]


def __getattr__(name):
    # Planner and Engine pull in torch; import them only when asked for.
    if name == "Planner":
        from mergepipe.planner.context import Planner
        return Planner
    if name == "Engine":
        from mergepipe.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'mergepipe' has no attribute {name!r}")
