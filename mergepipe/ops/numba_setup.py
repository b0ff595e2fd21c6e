"""numba's start-up, without the scipy import it does not need.

The first call of a jitted function in a process, even one loaded from numba's on-disk cache, builds
numba's CPU target, which imports ``numba.np.arraymath``; that module probes for a BLAS by importing
``scipy.linalg.cython_blas``, which pulls in scipy.linalg (measured: ~0.16 s of CPU of the ~0.45 s that
loading MergePipe's cached kernels costs). No MergePipe kernel uses BLAS, so the module is imported here
with that one import refused, and its answer set afterwards to what the probe would have found when scipy
is installed (only ``np.correlate``/``np.convolve`` in jitted code read it, and those import scipy
themselves when compiled). The same trick as ``catalog/db.py``'s import of sqlite_utils without pandas.

Imported by the modules that define MergePipe's kernels, before their first ``@njit``.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

_PROBE = "scipy.linalg.cython_blas"


def _import_arraymath():
    if "numba.np.arraymath" in sys.modules or _PROBE in sys.modules:
        return
    sys.modules[_PROBE] = None  # `import scipy.linalg.cython_blas` raises ImportError at once
    try:
        import numba.np.arraymath as arraymath
    finally:
        if sys.modules.get(_PROBE, 0) is None:
            del sys.modules[_PROBE]
    arraymath._HAVE_BLAS = find_spec("scipy") is not None


_import_arraymath()
