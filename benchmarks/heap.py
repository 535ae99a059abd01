"""The C heap under a CPU benchmark: glibc's default, or one that keeps the memory it is given.

With its defaults glibc gives freed memory back to the OS (it trims the top of its heap and unmaps
large blocks), and the next buffers written there take a page fault per 4 KiB page. Which step of
which method meets a trimmed heap depends on the order of allocations, not on the method: a step can
take 70,000 extra faults and 100 ms more one time and none the next (`python -m benchmarks.faults`
shows it step by step). On CUDA, PyTorch's caching allocator keeps memory and has no such effect;
on CPU, performance guides replace glibc's allocator (jemalloc, tcmalloc) for the same reason.
`keep_freed_memory` makes glibc keep what it gets, so that a CPU run compares the methods' compute.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1
_OLD_GLIBC_MMAP_CAP = 32 * 2**20  # older glibc refuses an mmap threshold above 32 MiB (64-bit)

DEFAULT = "the C library's default"


def keep_freed_memory() -> str:
    """Make this process's glibc heap keep freed memory instead of returning it to the OS.

    Irreversible for the process. Returns the description of the heap now in effect; raises
    RuntimeError where the C library is not glibc (mallopt missing) or refuses the settings.
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        raise RuntimeError("benchmarks: --keep-freed-memory needs glibc (mallopt); run without it here")
    if not mallopt(_M_TRIM_THRESHOLD, _LARGEST):
        raise RuntimeError("benchmarks: glibc refused mallopt(M_TRIM_THRESHOLD)")
    for threshold in (_LARGEST, _OLD_GLIBC_MMAP_CAP):
        if mallopt(_M_MMAP_THRESHOLD, threshold):
            largest = "any size" if threshold == _LARGEST else "up to 32 MiB"
            return f"glibc, freed memory kept (never trimmed; blocks of {largest} from the heap)"
    raise RuntimeError("benchmarks: glibc refused mallopt(M_MMAP_THRESHOLD)")
