"""What memory this process and the machine hold now: the readings the engine's memory watermarks act on.

On a Mac, MLX's arrays live in the same unified memory as every other
application's, so the number that matters is the machine's: a browser can
push it into swap (and the kernel into killing processes) long before the KV
pool reaches its budget. The engine therefore watches the memory the system
has in use (total minus available, as psutil reports it) against two
watermarks, and reports beside it this process's own footprint and what MLX
holds (its arrays, and the freed buffers it keeps for reuse).

The process footprint is macOS's ``phys_footprint`` (the number Activity
Monitor shows and the kernel judges a process by under memory pressure),
read through ``proc_pid_rusage``; elsewhere, or if that call fails, the
resident set size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import psutil

GIB = 2**30


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """One sample, in bytes."""

    system_total: int
    system_available: int
    process: int  # phys_footprint on macOS, the resident set elsewhere
    mlx_active: int  # MLX arrays alive now
    mlx_cache: int  # buffers MLX keeps for reuse (given back by mx.clear_cache())

    @property
    def system_used(self) -> int:
        return self.system_total - self.system_available


def read_memory() -> MemoryReading:
    vm = psutil.virtual_memory()
    return MemoryReading(int(vm.total), int(vm.available), process_footprint(), int(mx.get_active_memory()),
                         int(mx.get_cache_memory()))


def process_footprint() -> int:
    """This process's footprint (macOS ``phys_footprint``), else its resident set size."""
    footprint = _mac_footprint()
    return footprint if footprint is not None else int(psutil.Process().memory_info().rss)


def default_watermarks(total_bytes: int) -> tuple[int, int]:
    """(soft, hard) watermarks on the memory the system has in use, for a machine of ``total_bytes``: soft
    leaves 15% of it (at least 2 GiB) free, hard 5% (at least 1 GiB), each at least 1 GiB above nothing."""
    soft = total_bytes - max(total_bytes * 15 // 100, 2 * GIB)
    hard = total_bytes - max(total_bytes * 5 // 100, GIB)
    return max(soft, GIB // 2), max(hard, GIB)


# -- macOS: proc_pid_rusage(pid, RUSAGE_INFO_V0) -------------------------------------------------
class _RusageInfoV0(ctypes.Structure):
    # <sys/resource.h>: struct rusage_info_v0, the layout every later version starts with.
    _fields_ = [("ri_uuid", ctypes.c_uint8 * 16), ("ri_user_time", ctypes.c_uint64),
                ("ri_system_time", ctypes.c_uint64), ("ri_pkg_idle_wkups", ctypes.c_uint64),
                ("ri_interrupt_wkups", ctypes.c_uint64), ("ri_pageins", ctypes.c_uint64),
                ("ri_wired_size", ctypes.c_uint64), ("ri_resident_size", ctypes.c_uint64),
                ("ri_phys_footprint", ctypes.c_uint64), ("ri_proc_start_abstime", ctypes.c_uint64),
                ("ri_proc_exit_abstime", ctypes.c_uint64)]


@lru_cache(maxsize=1)
def _libproc() -> "ctypes.CDLL | None":
    if sys.platform != "darwin":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("proc") or "libproc.dylib", use_errno=True)
    except OSError:
        return None


def _mac_footprint() -> int | None:
    lib = _libproc()
    if lib is None:
        return None
    info = _RusageInfoV0()
    try:
        if lib.proc_pid_rusage(os.getpid(), 0, ctypes.byref(info)) != 0:
            return None
    except (AttributeError, OSError):
        return None
    return int(info.ri_phys_footprint)
