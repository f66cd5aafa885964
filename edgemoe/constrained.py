"""Run a command as if on a smaller machine: a memory cap (the page cache included, as the
kernel's memory cgroup counts it) and/or a cap on the read rate of the disk under a path.

    python -m edgemoe.constrained [--memory 8G] [--read-bps 20M] [--disk-of PATH] -- CMD ARGS...

The benchmarks use it to measure as on a Mac (an SSD read 30-50x slower than compute: cap
the disk at ~20 MB/s here) and at sizes beyond memory (cap the memory below the model).
It makes a cgroup for the command (v2, or v1's memory and blkio controllers), so it needs
root and a kernel that offers them; `why_unavailable()` says why not, and the tests that
need it skip with that reason. The exit status is the command's: 137 means the memory cap
killed it. At the end it prints `constrained: peak memory N bytes` to stderr (the cgroup's
peak use, page cache included) when the kernel reports one.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
MAX_SIZE = 2**60  # 1 EiB: more than any machine's memory or disk rate


def size(text: str) -> int:
    """Bytes of '8G', '300M', '512K', '1024' (binary units, as numfmt --from=iec)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 8G or 300M, got "
                                         f"{text[:40]!r}")
    value = float(m[1]) * _UNITS[m[2].upper()]
    if not 1 <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}{'...' if len(text) > 40 else ''}: "
                                         f"expected 1 byte to 1 EiB")
    return int(value)


def cgroup_version() -> Optional[int]:
    """2 (unified hierarchy), 1 (memory and blkio controllers mounted) or None."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return 2
    if (CGROUP_ROOT / "memory").is_dir() and (CGROUP_ROOT / "blkio").is_dir():
        return 1
    return None


def why_unavailable() -> Optional[str]:
    """None when caps can be set here; else why not (for a test's skip reason)."""
    if sys.platform != "linux":
        return f"cgroups are Linux's; this is {sys.platform}"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "making a cgroup needs root"
    version = cgroup_version()
    if version is None:
        return f"no cgroup v2 nor v1 memory/blkio controllers under {CGROUP_ROOT}"
    if version == 2:
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        missing = {"memory", "io"} - set(controllers)
        if missing:
            return f"cgroup v2 without the {', '.join(sorted(missing))} controller(s)"
    try:  # a read-only /sys (some containers)
        probe = _make(version, f"constrained-probe.{os.getpid()}")
        for folder in probe:
            folder.rmdir()
    except OSError as e:
        return f"cannot make a cgroup under {CGROUP_ROOT}: {e.strerror or e}"
    return None


def block_device(path: str) -> str:
    """MAJ:MIN of the block device holding `path` (its mount's source)."""
    if not os.path.exists(path):
        raise OSError(f"--disk-of {path}: no such file or folder")
    try:
        source = subprocess.run(["findmnt", "-no", "SOURCE", "--target", path], check=True,
                                capture_output=True, text=True).stdout.split("\n")[0].strip()
    except (OSError, subprocess.CalledProcessError):
        raise OSError(f"--disk-of {path}: findmnt cannot name its file system") from None
    try:
        rdev = os.stat(source).st_rdev
    except OSError:
        raise OSError(f"--disk-of {path}: its file system ({source or '?'}) is not on a "
                      f"block device whose reads can be capped") from None
    return f"{os.major(rdev)}:{os.minor(rdev)}"


def _make(version: int, name: str) -> List[Path]:
    if version == 2:
        with open(CGROUP_ROOT / "cgroup.subtree_control", "w") as f:
            f.write("+memory +io")
        folders = [CGROUP_ROOT / name]
    else:
        folders = [CGROUP_ROOT / "memory" / name, CGROUP_ROOT / "blkio" / name]
    for folder in folders:
        folder.mkdir(exist_ok=True)
    return folders


def run(command: List[str], memory: Optional[int] = None, read_bps: Optional[int] = None,
        disk_of: str = "/") -> int:
    """Run `command` in a new cgroup with the caps; its exit status (128 + a signal)."""
    reason = why_unavailable()
    if reason is not None:
        raise OSError(f"constrained: {reason}")
    version = cgroup_version()
    folders = _make(version, f"constrained.{os.getpid()}")
    try:
        if version == 2:
            group = folders[0]
            if memory is not None:
                (group / "memory.max").write_text(str(memory))
                if (group / "memory.swap.max").exists():
                    (group / "memory.swap.max").write_text("0")
            if read_bps is not None:
                (group / "io.max").write_text(f"{block_device(disk_of)} rbps={read_bps}")
        else:
            memory_group, blkio_group = folders
            if memory is not None:
                (memory_group / "memory.limit_in_bytes").write_text(str(memory))
                try:
                    (memory_group / "memory.swappiness").write_text("0")
                except OSError:
                    pass
            if read_bps is not None:
                (blkio_group / "blkio.throttle.read_bps_device").write_text(
                    f"{block_device(disk_of)} {read_bps}")

        def enter():
            for folder in folders:
                (folder / "cgroup.procs").write_text(str(os.getpid()))

        try:
            process = subprocess.Popen(command, preexec_fn=enter)
        except FileNotFoundError:
            raise OSError(f"constrained: {command[0]}: no such command") from None
        while True:
            try:
                code = process.wait()
                break
            except KeyboardInterrupt:  # the command has it too; wait for it to stop
                process.send_signal(signal.SIGINT)
        peak = _peak(version, folders[0])
        if peak is not None:
            print(f"constrained: peak memory {peak} bytes", file=sys.stderr)
        return 128 - code if code < 0 else code
    finally:
        for folder in folders:
            try:
                folder.rmdir()
            except OSError:
                pass


def _peak(version: int, group: Path) -> Optional[int]:
    name = "memory.peak" if version == 2 else "memory.max_usage_in_bytes"
    try:
        return int((group / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def command(*args: str) -> List[str]:
    """The argv prefix that runs a command under caps: `[python, -m, edgemoe.constrained,
    *args, --]` (for the benchmarks and tests)."""
    return [sys.executable, "-m", "edgemoe.constrained", *args, "--"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        split = argv.index("--")
        argv, cmd = argv[:split], argv[split + 1:]
    else:
        cmd = []
    p = argparse.ArgumentParser(
        prog="python -m edgemoe.constrained",
        usage="%(prog)s [--memory 8G] [--read-bps 20M] [--disk-of PATH] -- CMD ARGS...",
        description="Run a command under a memory cap (page cache included) and/or a cap "
                    "on the disk's read rate, in a cgroup of its own (needs root; cgroup v1 "
                    "or v2). Exit status: the command's (137: killed by the memory cap).")
    p.add_argument("--memory", type=size, default=None,
                   help="Memory cap, page cache included (8G, 300M)")
    p.add_argument("--read-bps", type=size, default=None,
                   help="Read rate cap of the disk under --disk-of, bytes/s (20M)")
    p.add_argument("--disk-of", default="/", metavar="PATH",
                   help="The disk whose reads are capped: the one holding PATH (default: /)")
    args = p.parse_args(argv)
    if not cmd:
        p.error("no command: give it after --")
    if not os.path.exists(args.disk_of):
        p.error(f"--disk-of {args.disk_of}: no such file or folder")
    try:
        sys.exit(run(cmd, args.memory, args.read_bps, args.disk_of))
    except OSError as e:
        sys.exit(str(e) if str(e).startswith("constrained:") else f"constrained: {e}")


if __name__ == "__main__":
    main()
