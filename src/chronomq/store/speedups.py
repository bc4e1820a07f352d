"""Which implementation of the hot-path kernels runs: the compiled ``chronomq.store._speedups`` (Cython, built
by ``pip install`` when a C compiler and Python's headers are there) or the pure-Python functions it mirrors.
``native`` is the compiled module, or None when it is not built or ``CHRONOMQ_PURE_PYTHON`` is set to
anything but "" or "0". Modules that own a kernel keep the pure function as ``<name>_py`` and rebind
``<name>`` to the compiled one when there is one; results and refusals are the same either way."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from types import ModuleType

PURE_ENV = "CHRONOMQ_PURE_PYTHON"


def _load() -> ModuleType | None:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    try:
        from chronomq.store import _speedups
    except ImportError:
        return None
    return _speedups


native: ModuleType | None = _load()

# zlib.crc32's results; compiled, it folds with carry-less multiplies where the CPU has them
crc32: Callable[..., int] = native.crc32 if native is not None else zlib.crc32


def describe() -> str:
    """One line for logs and benchmarks: which kernels are in use."""
    if native is not None:
        return "compiled (chronomq.store._speedups)"
    why = f"{PURE_ENV} set" if os.environ.get(PURE_ENV, "") not in ("", "0") else "not built"
    return f"pure Python ({why})"
