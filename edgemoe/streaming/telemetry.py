"""Memory as the OS sees it: peak RSS, memory available, the page cache a file occupies."""

import ctypes
import mmap
import os
import resource
import sys

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_MAP_FAILED = ctypes.c_void_p(-1).value


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    On Linux, VmHWM: ru_maxrss would carry over the parent's peak into a child process.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB elsewhere


def page_cache_bytes(path) -> int:
    """Bytes of `path` in the OS page cache now (mincore over a mapping; reads nothing)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap({path})")
        try:
            vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore({path})")
            return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cached_pages(path, offset: int = 0, length: int = 0):
    """Ask the OS to drop `path`'s clean cached pages in [offset, offset + length) (0: to
    the end). macOS has no posix_fadvise; there F_NOCACHE keeps reads out instead."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def available_memory_bytes() -> int:
    """Memory this process can still take without swapping: on Linux the kernel's
    MemAvailable, or less under a memory cgroup's limit (its usage less the page cache it
    could drop); elsewhere (macOS) 3/4 of the physical memory, the share MLX's Metal
    backend recommends for its working set."""
    if not sys.platform.startswith("linux"):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 3 // 4
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    found = [info.get("MemAvailable", info["MemFree"])]
    cgroup = _cgroup_room()
    if cgroup is not None:
        found.append(cgroup)
    return min(found)


def _cgroup_room():
    """limit - (usage - inactive page cache) of this process's memory cgroup, or None."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.strip().split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":  # v2
            base, names = f"/sys/fs/cgroup{path}", ("memory.max", "memory.current",
                                                    "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            base, names = f"/sys/fs/cgroup/memory{path}", ("memory.limit_in_bytes",
                                                           "memory.usage_in_bytes",
                                                           "total_inactive_file")
        else:
            continue
        try:
            limit = open(f"{base}/{names[0]}").read().strip()
            usage = int(open(f"{base}/{names[1]}").read())
            stat = dict(line.split() for line in open(f"{base}/memory.stat"))
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:  # no limit
            continue
        return int(limit) - (usage - int(stat.get(names[2], 0)))
    return None
