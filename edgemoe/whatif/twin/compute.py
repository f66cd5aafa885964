"""The model's compute in the twin: seconds per piece of a forward call on the profile's
machine (`Compute`), and the timed waits that stand for it (`Waiter`).

Waits are `time.sleep`, which releases the GIL as MLX's evaluation does, so reader threads
run beside them. A sleep that overshoots is paid back from the next waits, so the compute
total is what the model says; the Python between waits is dilated to the profile's CPU
(module doc of edgemoe.whatif.twin.engine).
"""

import time
import zlib
from dataclasses import dataclass, replace
from typing import Callable

from .profiles import Profile
from .shapes import Shape


@dataclass
class Compute:
    """Seconds of GPU (or CPU) work per piece of a forward call, on the profile's machine."""

    resident_layer_s: Callable[[int], float]  # tokens -> s
    experts_s: Callable[[int, int], float]  # (distinct experts, token-expert entries) -> s
    head_s: float
    host_sync_s: float
    method: str
    # the predictor at each MoE layer but the last (a prerouter head; advisory's next
    # router): tokens -> s
    heads_s: Callable[[int], float] = lambda t: 0.0
    # the GPU idles this long after a layer's first host sync while the host decides and
    # builds the layer's next work (profiles.json sync_idle_us); a layer without a sync
    # keeps the GPU queue full and pays nothing
    sync_idle_s: float = 0.0

    @classmethod
    def from_profile(cls, profile: Profile, shape: Shape) -> "Compute":
        """Bytes over the profile's int4 rate, or FLOPs over its prefill rate if more."""
        rate = profile.value("int4_gbps") * 1e9
        flops = profile.value("prefill_tflops") * 1e12
        heads = shape.prerouter_head_params
        # (the shape's figures found once: the twin's own Python between waits is counted
        # as the model's, and `record_bytes` lays out a record each time it is asked)
        resident_bytes, resident_params = shape.resident_compute_bytes, \
            shape.resident_params_per_layer
        record_bytes, expert_params = shape.record_bytes, shape.expert_params
        return cls(
            lambda t: max(resident_bytes / rate, 2 * resident_params * t / flops),
            lambda n, entries: max(n * record_bytes / rate,
                                   2 * expert_params / 3 * 3 * entries / flops),
            shape.head_bytes / rate, profile.value("host_sync_us") * 1e-6,
            f"profile {profile.name}: weights / int4_gbps, or 2 x params x tokens / "
            f"prefill_tflops if longer",
            lambda t: max(4 * heads / rate, 2 * heads * t / flops),  # float32 heads
            profile.value("sync_idle_us") * 1e-6 if "sync_idle_us" in profile.figures else 0.0)

    @classmethod
    def calibrated(cls, decode_s: float, prefill_s_per_token: float, layers: int, top_k: int,
                   host_sync_s: float, expert_share: float = 0.5) -> "Compute":
        """From a measured resident run of the same model (this machine): `decode_s` per
        decode step and `prefill_s_per_token` less the twin's own overhead, spread evenly
        over layers, `expert_share` of each layer's to its experts."""
        per_layer = decode_s / layers
        per_layer_pre = prefill_s_per_token / layers
        return cls(
            lambda t: max(per_layer * (1 - expert_share), per_layer_pre * (1 - expert_share) * t),
            lambda n, entries: max(per_layer * expert_share * n / top_k,
                                   per_layer_pre * expert_share * entries / top_k),
            0.0, host_sync_s, "calibrated on a resident run of the same model")

    def with_heads(self, decode_s: float, prefill_s_per_token: float) -> "Compute":
        """The predictor's cost per layer, measured (this machine): what a resident run of
        its mode took per decode step and per prompt token beyond this compute's twin,
        spread over the layers that run one."""
        return replace(self, heads_s=lambda t: max(decode_s, prefill_s_per_token * t),
                       method=self.method + "; the predictor calibrated on a resident run")

    def scaled(self, factor: float) -> "Compute":
        return Compute(lambda t: self.resident_layer_s(t) * factor,
                       lambda n, e: self.experts_s(n, e) * factor, self.head_s * factor,
                       self.host_sync_s * factor, self.method + f" x{factor:g}",
                       lambda t: self.heads_s(t) * factor, self.sync_idle_s * factor)


_SPIN = bytes(16384)  # zlib.crc32 of it: ~5 us of one core, the GIL released


def spin(seconds: float):
    """Keep one core busy for `seconds` (wall), as compute on this CPU does; other threads
    (the readers) may take the GIL meanwhile, and must find a core."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        zlib.crc32(_SPIN)


class Waiter:
    """Timed waits that stand for compute, and the Python between them dilated. `busy`:
    a wait keeps a core busy (`spin`) instead of sleeping, as compute does where it runs on
    this CPU (a validation here), so that the readers find the cores as taken as they
    were beside the real compute."""

    def __init__(self, stretch: float, python_factor: float = 1.0, blocked=lambda: 0.0,
                 contending=None, busy: bool = False):
        self.stretch, self.python_factor, self.blocked = stretch, python_factor, blocked
        self.sleep = spin if busy else time.sleep
        # CPU seconds other threads spend (the reader's CRC32s and copies) that a compute
        # wait must make up for: where compute runs on this CPU (a validation here), a
        # read that overlaps compute slows it; a sleep does not feel it
        self.contending = contending
        self.contended = 0.0
        self.debt = 0.0  # slept beyond what was asked, paid back by later waits
        self.asked = self.slept = self.python_s = self.python_pad = 0.0
        self.compute = 0.0  # of `asked`, the profile's compute and syncs (x stretch)
        self._mark = None
        self._blocked_at = blocked()

    def _python_since_mark(self) -> float:
        now = time.perf_counter()
        blocked = self.blocked()
        p = 0.0
        if self._mark is not None:
            p = max(0.0, now - self._mark - (blocked - self._blocked_at))
        self._blocked_at = blocked
        return p

    def wait(self, seconds: float):
        """Wait `seconds` of the profile's machine (x stretch here)."""
        python = self._python_since_mark()
        self.python_s += python
        pad = python * (self.python_factor - 1) if self.python_factor > 1 else 0.0
        self.python_pad += pad
        want = seconds * self.stretch + pad
        self.asked += want
        self.compute += seconds * self.stretch
        sleep = want - self.debt
        tic = time.perf_counter()
        cpu_before = self.contending() if self.contending else 0.0
        if sleep > 0:
            self.sleep(sleep)
        if self.contending and seconds > 0:
            stolen = self.contending() - cpu_before
            if stolen > 0:
                self.sleep(stolen)
                self.contended += stolen
                want += stolen
                self.asked += stolen
                self.compute += stolen
        took = time.perf_counter() - tic
        self.slept += took
        self.debt = max(0.0, self.debt + took - want)
        self._mark = time.perf_counter()
