"""The one place that chooses which implementation of the hot-path kernels runs: the compiled
``chronomq.store._speedups`` (Cython, built by ``pip install`` where a C compiler and Python's headers are)
or the pure-Python twins it mirrors. Callers use ``kernels`` (typed by ``Kernels``): the compiled module, or,
when it is not built or ``CHRONOMQ_PURE_PYTHON`` is set to anything but "" or "0", an object holding the
pure twins, which their modules register under the kernel's name with ``pure_twin``. Results and refusals
are the same either way.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from chronomq.message import encode_record

if TYPE_CHECKING:
    from chronomq.message import MessageExt
    from chronomq.store.commitlog import CommitLog
    from chronomq.store.types import DispatchRequest, EncodedRecord

PURE_ENV = "CHRONOMQ_PURE_PYTHON"

Buffer = bytes | bytearray | memoryview | mmap.mmap
F = TypeVar("F", bound=Callable[..., Any])


class Kernels(Protocol):
    """The kernels, each a drop-in for its pure twin (named after the module that holds the twin).
    The timer's kernels take and fill the timer store's own item types (chronomq.delay.timer), which
    store/ does not import: Any here."""

    def crc32(self, data: Buffer, value: int = 0, /) -> int:
        """zlib.crc32."""
        ...

    def splice(self, buf: Buffer, pos: int, size: int, topic_b: bytes, queue_id: int, props_b: bytes,
               store_host_b: bytes, /) -> tuple[bytes, int]:
        """commitlog.splice_py."""
        ...

    def property_fields(self, props: dict[str, str], /
                        ) -> tuple[bytes, str | None, list[str] | None, str | None] | int:
        """put.property_fields_py."""
        ...

    def append_run(self, mm: Buffer, r: int, wrote: int, qoff: int, ts: int, entries: list[EncodedRecord],
                   topic: str, qid: int, pending: list[DispatchRequest], /) -> tuple[int, int, int]:
        """put.append_run_py."""
        ...

    def batch_records(self, data: Buffer, topic_b: bytes, queue_id: int, sys_flag: int, born_ts: int,
                      born_host_b: bytes, store_host_b: bytes, reconsume: int, stamps_b: bytes,
                      special: tuple[bytes, ...], max_body: int, max_record: int, tag_cache: dict[str, int], /
                      ) -> tuple[list[EncodedRecord], list[str | None] | None, int] | None:
        """put.batch_records_py."""
        ...

    def encode_record(self, msg: MessageExt, properties_text: str | None = None, /) -> bytearray:
        """message.encode_record."""
        ...

    def index_entries(self, mm: Buffer, entries_at: int, allocated: int, slots: bytearray, slot_num: int,
                      n: int, index_num: int, begin_ts: int, items: list[DispatchRequest], i: int, w: int,
                      dirty: set[int], /) -> tuple[int, int, int, int, int, int, int, int]:
        """index.index_entries_py."""
        ...

    def index_query(self, topic: str, keys: list[str],
                    files: list[tuple[Buffer, int, bytearray | None, int, int, int, int]], limit: int,
                    begin_ts: int, end_ts: int, /) -> dict[str, list[int]]:
        """index.index_query_py."""
        ...

    def record_to_put(self, buf: Buffer, pos: int, size: int, /) -> tuple[str, int, dict[str, str]]:
        """delay.delivery.record_to_put."""
        ...

    def batch_items(self, data: Buffer, /) -> list[tuple[bytes, dict[str, str], int]]:
        """remoting.codec.batch_items."""
        ...

    def due_ms_of(self, rec: bytes, /) -> int | None:
        """broker.processors.pull.due_ms_of_py."""
        ...

    def count_lateness(self, records: list[bytes], now: int, lates: dict[int, int], /) -> None:
        """broker.processors.pull.count_lateness_py."""
        ...

    def props_marks(self, records: list[bytes], marks: tuple[bytes, ...], /) -> int:
        """broker.processors.pull.props_marks_py."""
        ...

    def pack_timer_records(self, encoded: list[tuple[MessageExt, int, bytearray]], tids: dict[str, int],
                           now: int, origin: int, pos: int, seg_size: int,
                           placed: list[tuple[int, int, int, int]], hash_items: list[tuple[int, int]],
                           results: list[Any], result_cls: Callable[..., Any], id_prefix: str, /
                           ) -> tuple[list[tuple[int, bytearray]], int]:
        """delay.timer.append.pack_timer_records_py."""
        ...

    def pack_index_entries(self, links: list[tuple[int, int, int, int, int]], floor: int, slot_ms: int,
                           start_idx: int, per_seg: int, seg_max: dict[int, int], hot: int,
                           wheel_get: Callable[[int], int], /
                           ) -> tuple[bytearray, dict[int, int], list[tuple[int, Any]], int | None]:
        """delay.timer.append.pack_index_entries_py."""
        ...

    def pack_hash_entries(self, items: list[tuple[int, int]], count: int, buckets: int, bmap: Buffer,
                          backed: set[int], /) -> tuple[bytearray, dict[int, int], int]:
        """delay.timer.files.pack_hash_entries_py."""
        ...

    def read_units(self, units: bytes, cl: CommitLog, min_phys: int, max_msgs: int, max_bytes: int, /
                   ) -> tuple[list[bytes], int, int]:
        """reads.read_units_py."""
        ...

    def queue_runs(self, batch: list[DispatchRequest], /) -> list[tuple[str, int, int, bytes, int, int]]:
        """reput.queue_runs_py."""
        ...

    def mark_delivered_run(self, group: list[Any], t: int, seq: int, marks: dict[int, Any], buf: bytearray,
                           pending: Any, lates: dict[tuple[int, int], int], out: list[str], /) -> int:
        """delay.timer.window.mark_delivered_run_py."""
        ...

    def scan_records(self, buf: Buffer, buf_at: int, have: int, pos: int, stop: int, limit: int,
                     marks: dict[int, Any], done_seq: int, open_ranges: list[tuple[int, int]], min_run: int,
                     st: list[Any], runs: list[tuple[int, int]], /) -> tuple[int, int, bool]:
        """delay.timer.retention.scan_records_py."""
        ...


class NativeKernels(Kernels, Protocol):
    """The compiled module: the kernels and two CRC functions that have no pure twin."""

    def crc32_bytewise(self, data: Buffer, value: int = 0, /) -> int:
        """The table path of ``crc32`` alone (what a CPU without PCLMULQDQ runs)."""
        ...

    def crc32_folds(self) -> bool:
        """Whether ``crc32`` folds with carry-less multiplies on this CPU."""
        ...


KERNEL_NAMES = frozenset(name for name in vars(Kernels) if not name.startswith("_"))


class _PureKernels:
    """The pure twins, each set as an attribute under its kernel's name by ``pure_twin``."""

    def __getattr__(self, name: str) -> Any:  # only reached for a name no module has registered
        raise AttributeError(f"no pure twin of the kernel {name!r} is registered: the module that defines it "
                             "registers it with chronomq.store.speedups.pure_twin when it is imported")


def _pure_asked() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def _load() -> NativeKernels | None:
    if _pure_asked():
        return None
    try:
        from chronomq.store import _speedups
    except ImportError:
        return None
    return _speedups


_compiled = _load()
_pure = _PureKernels()
kernels: Kernels = _compiled if _compiled is not None else cast(Kernels, _pure)
# The compiled module or None: for ``describe`` and for tests that hold a kernel to its twin. Code calls
# ``kernels`` (a module binds ``name = kernels.name`` once its twin is registered).
native: NativeKernels | None = _compiled
twins: dict[str, Callable[..., Any]] = {}  # the pure twins registered so far, by kernel name


def pure_twin(name: str) -> Callable[[F], F]:
    """Decorator: register the function as the pure twin of the kernel ``name``; it runs as
    ``kernels.<name>`` when the compiled module does not. The function itself is returned unchanged."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"{name!r} is not a kernel of chronomq.store._speedups")

    def register(fn: F) -> F:
        twins[name] = fn
        if _compiled is None:
            setattr(_pure, name, fn)
        return fn

    return register


pure_twin("crc32")(zlib.crc32)  # compiled, it folds with carry-less multiplies where the CPU has them
pure_twin("encode_record")(encode_record)
crc32: Callable[..., int] = kernels.crc32


def describe() -> str:
    """One line for logs and benchmarks: which kernels are in use."""
    if native is not None:
        return "compiled (chronomq.store._speedups)"
    return f"pure Python ({PURE_ENV} set)" if _pure_asked() else "pure Python (not built)"
