"""MergePipe: budget-aware parameter management for weight-space model merging.

Catalog -> Plan -> Execute -> Manifest. The library never imports Streamlit.
"""

__version__ = "0.1.0"

from .catalog import Catalog  # noqa: E402
from .errors import MergePipeError  # noqa: E402

__all__ = ["Catalog", "MergePipeError", "__version__"]
