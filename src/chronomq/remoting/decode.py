"""The one place that chooses which implementation of the client's pull-answer decode runs: the compiled
``chronomq.remoting._decode`` (Cython, built by ``pip install`` beside the store's kernels, where a C
compiler and Python's headers are) or the pure-Python twins in chronomq.client.model, which register here
with ``pure_twin``. Callers use ``kernels`` (typed by ``Kernels``): the compiled module, or, when it is not
built or ``CHRONOMQ_PURE_PYTHON`` is set to anything but "" or "0", an object holding the twins. Results
and refusals are the same either way. The client's classes come in as arguments: remoting/ does not import
client/.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

PURE_ENV = "CHRONOMQ_PURE_PYTHON"  # the switch chronomq.store.speedups honours too

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")
R = TypeVar("R")


class Kernels(Protocol):
    """The decode kernels, each a drop-in for its twin in chronomq.client.model (``<name>_py``)."""

    def record_columns(self, buf: bytes, cls: Callable[..., C], /) -> C:
        """model.record_columns_py: ``cls`` called with the 14 columns of model.RecordColumns, in order."""
        ...

    def decode_received(self, buf: bytes, broker_name: str, received_cls: type[R],
                        queue_cls: Callable[[str, str, int], Any], /) -> list[R]:
        """model.decode_received_py."""
        ...

    def parse_properties(self, text: str, /) -> dict[str, str]:
        """model.parse_properties_py."""
        ...

    def record_buffers(self, parts: list[tuple[bytes, int, int]], want: int, /) -> dict[str, Any] | None:
        """model.record_buffers: Arrow column buffers, or None for the general path (the twin's answer)."""
        ...


KERNEL_NAMES = frozenset(name for name in vars(Kernels) if not name.startswith("_"))


class _PureKernels:
    """The pure twins, each set as an attribute under its kernel's name by ``pure_twin``."""

    def __getattr__(self, name: str) -> Any:  # only reached for a name no module has registered
        raise AttributeError(f"no pure twin of the kernel {name!r} is registered: chronomq.client.model "
                             "registers the decode's twins with chronomq.remoting.decode.pure_twin")


def _pure_asked() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def _load() -> Kernels | None:
    if _pure_asked():
        return None
    try:
        from chronomq.remoting import _decode
    except ImportError:
        return None
    return _decode


_compiled = _load()
_pure = _PureKernels()
kernels: Kernels = _compiled if _compiled is not None else cast(Kernels, _pure)
# The compiled module or None: for ``describe`` and for tests that hold a kernel to its twin.
native: Kernels | None = _compiled
twins: dict[str, Callable[..., Any]] = {}  # the pure twins registered so far, by kernel name


def pure_twin(name: str) -> Callable[[F], F]:
    """Decorator: register the function as the pure twin of the kernel ``name``; it runs as
    ``kernels.<name>`` when the compiled module does not. The function itself is returned unchanged."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"{name!r} is not a kernel of chronomq.remoting._decode")

    def register(fn: F) -> F:
        twins[name] = fn
        if _compiled is None:
            setattr(_pure, name, fn)
        return fn

    return register


def describe() -> str:
    """One line for logs and benchmarks: which decode is in use."""
    if native is not None:
        return "compiled (chronomq.remoting._decode)"
    return f"pure Python ({PURE_ENV} set)" if _pure_asked() else "pure Python (not built)"
