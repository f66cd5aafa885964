"""edgemoe.constrained: a memory cap and a read-rate cap through the kernel's cgroups
(v1 or v2); skipped, with the reason, where the kernel or the user cannot make one."""

import subprocess
import sys
import time

import pytest

from edgemoe import constrained

REASON = constrained.why_unavailable()
needs_cgroups = pytest.mark.skipif(REASON is not None, reason=f"no cgroups here: {REASON}")


def test_sizes_are_binary_units():
    assert constrained.size("8G") == 8 * 2**30
    assert constrained.size("300M") == 300 * 2**20
    assert constrained.size("1.5K") == 1536 and constrained.size("1024") == 1024
    assert constrained.size("2GiB") == 2 * 2**30
    with pytest.raises(Exception):
        constrained.size("lots")


def test_a_command_is_required():
    r = subprocess.run([sys.executable, "-m", "edgemoe.constrained", "--memory", "1G"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "no command" in r.stderr


@needs_cgroups
def test_the_memory_cap_kills_a_command_over_it():
    ok = subprocess.run(constrained.command("--memory", "200M") + [
        sys.executable, "-c", "x = bytearray(20 * 2**20)"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "constrained: peak memory" in ok.stderr
    over = subprocess.run(constrained.command("--memory", "60M") + [
        sys.executable, "-c", "x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096])"],
        capture_output=True, text=True)
    assert over.returncode == 137, over.stderr


@needs_cgroups
def test_the_read_rate_cap_slows_direct_reads(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * (4 * 2**20 // 256))  # 4 MiB
    read = ["dd", f"if={data}", "of=/dev/null", "bs=1M", "iflag=direct"]
    free = subprocess.run(read, capture_output=True, text=True)
    if free.returncode != 0:
        pytest.skip(f"O_DIRECT reads fail on {tmp_path}: {free.stderr.strip()[-120:]}")
    tic = time.perf_counter()
    r = subprocess.run(constrained.command("--read-bps", "8M", "--disk-of", str(tmp_path))
                       + read, capture_output=True, text=True)
    elapsed = time.perf_counter() - tic
    if r.returncode != 0 and "block device" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert elapsed > 0.35, elapsed  # 4 MiB at 8 MiB/s: about half a second


@needs_cgroups
def test_the_exit_status_is_the_commands():
    r = subprocess.run(constrained.command() + [sys.executable, "-c", "raise SystemExit(3)"],
                       capture_output=True)
    assert r.returncode == 3
