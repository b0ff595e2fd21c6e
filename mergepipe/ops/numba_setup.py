"""numba's start-up, without the scipy and cffi imports it does not need.

``import numba`` imports scipy only to check its version (~40 ms); the first call of a jitted function, even one
loaded from numba's on-disk cache, builds numba's CPU target, which imports ``numba.np.arraymath`` (it probes for
a BLAS by importing ``scipy.linalg.cython_blas``: ~0.16 s of CPU) and ``numba.core.typing.cffi_utils`` (it imports
cffi and pycparser to type cffi functions: ~30 ms). No MergePipe kernel uses BLAS or cffi, so these modules are
imported here with those imports refused, as numba runs where scipy and cffi are not installed; arraymath's answer
is set afterwards to what its probe would have found (only ``np.correlate``/``np.convolve`` in jitted code read
it, and those import scipy themselves when compiled). The same trick as ``catalog/db.py``'s import of sqlite_utils
without pandas.

Imported by the modules that define MergePipe's kernels, before their first ``@njit``.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from importlib.util import find_spec


@contextmanager
def _refused(*names: str):
    """``import name`` raises ImportError at once inside the block, for each name not imported yet."""
    hidden = [n for n in names if n not in sys.modules]
    for n in hidden:
        sys.modules[n] = None
    try:
        yield
    finally:
        for n in hidden:
            if sys.modules.get(n, 0) is None:
                del sys.modules[n]


def _import_numba():
    if "numba.np.arraymath" not in sys.modules:
        with _refused("scipy", "scipy.linalg.cython_blas"):  # the latter where scipy itself is loaded already
            import numba.np.arraymath as arraymath
        arraymath._HAVE_BLAS = find_spec("scipy") is not None
    if "numba.core.typing.cffi_utils" not in sys.modules:
        with _refused("cffi"):
            import numba.core.typing.cffi_utils  # noqa: F401


_import_numba()
