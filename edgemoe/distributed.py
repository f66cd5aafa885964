"""Several hosts as one model: each owns a share of every MoE layer's routed experts.

    mlx.launch --backend ring --hosts IP1,IP2 -- python -m edgemoe.generate --distributed --model M
    model, tokenizer = edgemoe.load(M, group=edgemoe.distributed.connect())

Built on MLX's own distributed layer (`mx.distributed`, launched by `mlx.launch`). Every
host keeps the resident weights (attention, routers, shared experts) and runs the whole
forward pass. Host h owns a partition of each layer's routed experts (`Partition`), and
its store holds, reads and budgets only those. At a MoE layer each host computes the
(token, k) rows routed to its experts, the other rows are exact zeros, and `all_sum`
adds them up: every row comes from exactly one host and adding zeros is exact, so the
output is bit-identical to one host's. The routers see the same hidden states on every
host, so they route alike and no host needs to tell another what it routed.

A host that dies makes MLX's ring fail its peers' next `all_sum`; one that stops
answering is caught by a deadline (`group_timeout`). Either way every host exits with one
line naming the hosts it lost, never a hang: a collective cannot be cancelled, so a host
whose group is gone stops (`GroupWatch`).
"""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .format.pack import Pack, PackError
from .options import DEFAULT_TIMEOUT_S  # a collective waiting longer means a host is gone


class GroupError(ConnectionError):
    """A host of the group died, stopped answering, or disagrees about the model."""


# ---- which host owns which expert -------------------------------------------------------

@dataclass(frozen=True)
class Partition:
    """The owner (a host's rank) of every routed expert, per MoE layer (by decoder index)."""

    hosts: int
    owners: Dict[int, np.ndarray]
    kind: str  # round-robin, or trace (balanced by measured routing)

    @classmethod
    def round_robin(cls, pack: Pack, hosts: int) -> "Partition":
        """Expert e of every layer to host e mod hosts."""
        return cls(hosts, {l.index: np.arange(l.num_experts) % hosts for l in pack.layers},
                   "round-robin")

    @classmethod
    def balanced(cls, pack: Pack, hosts: int, trace: Dict[str, np.ndarray]) -> "Partition":
        """Equal work per host: each layer's experts by how often the trace routed to them,
        dealt out in a snake (0, 1, .., H-1, H-1, .., 0), so every host gets as many
        experts (within one) and about as many routed rows."""
        layers = trace["layers"].tolist()
        owners = {}
        for layer in pack.layers:
            if layer.index not in layers:
                raise ValueError(f"--partition: the trace has no MoE layer {layer.index}; "
                                 f"it was recorded on another model")
            routed = trace["routed"][:, layers.index(layer.index)].reshape(-1)
            if routed.size and routed.max() >= layer.num_experts:
                raise ValueError(f"--partition: the trace routes to expert {routed.max()} of "
                                 f"layer {layer.index}, which has {layer.num_experts}; it was "
                                 f"recorded on another model")
            counts = np.bincount(routed, minlength=layer.num_experts)
            order = np.argsort(-counts, kind="stable")
            snake = np.concatenate([np.arange(hosts), np.arange(hosts)[::-1]])
            owner = np.empty(layer.num_experts, dtype=np.int64)
            owner[order] = snake[np.arange(layer.num_experts) % (2 * hosts)]
            owners[layer.index] = owner
        return cls(hosts, owners, "trace")

    def owned(self, rank: int) -> Dict[int, np.ndarray]:
        """Per layer, which experts `rank` owns (a boolean mask)."""
        return {layer: owner == rank for layer, owner in self.owners.items()}

    @property
    def fingerprint(self) -> str:
        data = json.dumps([self.hosts, sorted((l, o.tolist()) for l, o in self.owners.items())])
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def shard_info(self, rank: int) -> dict:
        """What a shard's manifest records of its partition."""
        return {"index": rank, "hosts": self.hosts, "partition": self.kind,
                "owners": {str(l): o.tolist() for l, o in sorted(self.owners.items())}}

    @classmethod
    def from_shard(cls, shard: dict) -> "Partition":
        return cls(int(shard["hosts"]),
                   {int(l): np.array(o, dtype=np.int64) for l, o in shard["owners"].items()},
                   shard.get("partition", "round-robin"))


def parse_shard(text: str):
    """`i/N` (convert --shard): host i of N, counted from 0."""
    try:
        index, hosts = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected i/N, e.g. 0/2 (host 0 of 2)") from None
    if hosts < 1 or not 0 <= index < hosts:
        raise ValueError(f"--shard {text}: the host i of N is counted from 0 to N-1")
    return index, hosts


def make_partition(pack: Pack, hosts: int, trace_path=None) -> Partition:
    """The partition a pack is served with: the one a shard records, else balanced by the
    routing in `trace_path` (a .npz of edgemoe.generate --trace), else round-robin."""
    if pack.shard is not None:
        carried = Partition.from_shard(pack.shard)
        if trace_path is not None:
            given = make_partition(replace(pack, shard=None), hosts, trace_path)
            if given.fingerprint != carried.fingerprint:
                raise ValueError(f"--partition {trace_path}: {pack.path} is a shard of another "
                                 f"partition ({carried.kind}); drop --partition")
        return carried
    if trace_path is None:
        return Partition.round_robin(pack, hosts)
    from .streaming.trace import load_trace

    return Partition.balanced(pack, hosts, load_trace(trace_path))


def host_share(pack: Pack, partition: Partition, rank: int) -> Pack:
    """`pack` as host `rank` serves it: the records of its own experts only (its store
    reads, holds and budgets nothing else). A shard must be this host's and hold them all."""
    owned = partition.owned(rank)
    if pack.shard is not None:
        if (pack.shard["index"], pack.shard["hosts"]) != (rank, partition.hosts):
            raise PackError(f"{pack.path}: the shard of host {pack.shard['index']} of "
                            f"{pack.shard['hosts']}, run as host {rank} of {partition.hosts}; "
                            f"give each host its own (convert --shard {rank}/{partition.hosts})")
    layers = []
    for layer in pack.layers:
        mine = owned[layer.index]
        missing = np.flatnonzero(mine & ~layer.owned)
        if len(missing):
            raise PackError(f"{pack.path}: layer {layer.index} lacks expert {missing[0]}, "
                            f"which host {rank} owns")
        layers.append(replace(layer, records=[r if m else None
                                              for r, m in zip(layer.records, mine)]))
    return replace(pack, layers=layers, files=list(pack.files))


# ---- the group ----------------------------------------------------------------------------

def ring_hosts() -> List[str]:
    """Each rank's address, as mlx.launch's ring hostfile gives it (empty if unknown)."""
    try:
        hosts = json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())
        return [h[0] if isinstance(h, list) else str(h) for h in hosts]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return []


def host_name(rank: int, hosts: Optional[List[str]] = None) -> str:
    hosts = ring_hosts() if hosts is None else hosts
    return f"host {rank} ({hosts[rank]})" if rank < len(hosts) else f"host {rank}"


# MLX's init holds the GIL while it waits for its peers, so its deadline is kept by a
# separate process: it kills this one unless told in time that the group is up.
_INIT_WATCH = """
import os, select, signal, sys
pid, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], timeout)
if not ready or not sys.stdin.read(1):
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(0)
    if not ready:
        sys.stderr.write(message + chr(10)); sys.stderr.flush()
        os.kill(pid, signal.SIGKILL)
"""


def connect(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "any"):
    """Join the group mlx.launch started (mx.distributed.init), within `timeout_s`: a host
    that never comes up makes this one exit with a clear error instead of waiting."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        raise GroupError("--distributed: this MLX has no distributed backend")
    rank = os.environ.get("MLX_RANK", "?")
    message = (f"edgemoe: error: host {rank}: the group of {len(ring_hosts()) or '?'} hosts "
               f"({', '.join(ring_hosts()) or 'MLX_HOSTFILE'}) did not come up within "
               f"{timeout_s:g} s (--group-timeout); is every host started, and reachable?")
    watch = subprocess.Popen([sys.executable, "-S", "-c", _INIT_WATCH, str(os.getpid()),
                              str(timeout_s), message], stdin=subprocess.PIPE)
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise GroupError(f"--distributed: {e}; start the hosts with mlx.launch") from None
    finally:
        watch.stdin.write(b"1")
        watch.stdin.close()
        watch.wait()
    return group


class GroupWatch:
    """Runs a host's collectives under a deadline, and turns a lost host into one line.

    A ring peer that dies fails the next collective at once (a GroupError naming it); a
    collective still waiting after `timeout_s` means a host stopped answering: a
    collective cannot be cancelled, so the process prints why and exits with status 1.
    MLX waits without the GIL, which lets the watching thread run."""

    def __init__(self, group, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.size = group.rank(), group.size()
        self.hosts = ring_hosts()
        self.collective_s = 0.0  # time spent in collectives (the benchmark's share)
        self._deadline: Optional[float] = None
        self._what = ""
        self._thread = threading.Thread(target=self._watch, name="edgemoe-group-watch",
                                        daemon=True)
        self._thread.start()

    @property
    def me(self) -> str:
        return f"{host_name(self.rank, self.hosts)} of {self.size}"

    def peers(self) -> str:
        """The hosts this one talks to: its ring neighbours."""
        near = sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank})
        return " or ".join(host_name(r, self.hosts) for r in near)

    def all_sum(self, array, what: str):
        """`mx.distributed.all_sum(array)`, evaluated under the deadline."""
        import mlx.core as mx

        out = mx.distributed.all_sum(array, group=self.group)
        self._what, tic = what, time.perf_counter()
        self._deadline = time.monotonic() + self.timeout_s
        try:
            mx.eval(out)
        except RuntimeError as e:
            raise GroupError(f"{self.me}: {what}: lost {self.peers()} ({e})") from None
        finally:
            self._deadline = None
            self.collective_s += time.perf_counter() - tic
        return out

    def _watch(self):
        while True:
            time.sleep(min(0.2, self.timeout_s / 4))
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(f"edgemoe: error: {self.me}: {self._what}: no answer from "
                                 f"{self.peers()} for {self.timeout_s:g} s "
                                 f"(--group-timeout); stopping\n")
                sys.stderr.flush()
                os._exit(1)

    def all_ok(self, error: Optional[BaseException], what: str):
        """Raise `error` here, and a GroupError naming this host on the others."""
        import mlx.core as mx

        flags = np.zeros(self.size, dtype=np.int32)
        flags[self.rank] = error is not None
        flags = np.array(self.all_sum(mx.array(flags), what))
        if error is not None:
            raise error
        failed = np.flatnonzero(flags).tolist()
        if failed:
            raise GroupError(f"{self.me}: {', '.join(host_name(r, self.hosts) for r in failed)} "
                             f"failed {what} (its own error says why)")

    def agree(self, value: str, what: str):
        """Every host must have the same `value` (a fingerprint): a GroupError names the
        hosts that differ, on every host."""
        import mlx.core as mx

        digest = np.frombuffer(hashlib.sha256(value.encode()).digest()[:8], dtype=np.uint8)
        table = np.zeros((self.size, 8), dtype=np.int32)
        table[self.rank] = digest
        table = np.array(self.all_sum(mx.array(table), f"checking {what}"))
        differ = [r for r in range(self.size) if not np.array_equal(table[r], table[0])]
        if differ:
            raise GroupError(f"{self.me}: the hosts disagree on {what}: "
                             f"{', '.join(host_name(r, self.hosts) for r in differ)} differ "
                             f"from {host_name(0, self.hosts)}")


@dataclass
class HostShare:
    """What one host of a group serves: its rank's experts, and the collectives' watch."""

    partition: Partition
    watch: GroupWatch

    @property
    def rank(self) -> int:
        return self.watch.rank

    def common_seed(self) -> int:
        """A random seed drawn by host 0 and known to all: hosts that sample must draw
        alike, or their tokens (and with them their routing) would part."""
        import mlx.core as mx

        seed = np.zeros(2, dtype=np.int32)
        if self.rank == 0:
            seed[:] = np.random.randint(0, 2**31 - 1, size=2)
        seed = np.array(self.watch.all_sum(mx.array(seed), "agreeing on a random seed"))
        return int(seed[0]) << 31 | int(seed[1])

    def broadcast(self, obj, what: str):
        """Host 0's `obj` (any picklable value), on every host (as mlx_lm.server shares
        its requests: its size, then its bytes, each an all_sum with zeros elsewhere)."""
        import pickle

        import mlx.core as mx

        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == 0 else None
        size = self.watch.all_sum(mx.array([0 if data is None else len(data)]), what)
        buffer = mx.array(data) if data is not None else mx.zeros(int(size.item()), mx.uint8)
        shared = self.watch.all_sum(buffer, what)
        return obj if self.rank == 0 else pickle.loads(bytes(np.array(shared)))

    def combine(self, parts, shape, layer: int):
        """The layer's output on every host: this host's rows (`parts`: (rows, values) of
        edgemoe.streaming.calls, rows flat over (token, k)) beside exact zeros for the
        others', summed over the group. Returns shape + (hidden,)."""
        import mlx.core as mx

        rows = np.concatenate([r for r, _ in parts])
        values = mx.concatenate([y for _, y in parts]) if len(parts) > 1 else parts[0][1]
        full = mx.zeros((int(np.prod(shape)), values.shape[-1]), dtype=values.dtype)
        if len(rows):
            full[mx.array(rows)] = values
        out = self.watch.all_sum(full, f"layer {layer}")
        return out.reshape(*shape, out.shape[-1])


def share_for(pack: Pack, group, partition_path=None,
              timeout_s: float = DEFAULT_TIMEOUT_S):
    """(host `group.rank()`'s view of `pack`, its HostShare). Every host checks its own
    part, then that all agree on the model's layout and the partition; a problem on any
    host fails every host (a host alone failing would leave the others waiting)."""
    watch = GroupWatch(group, timeout_s)
    view = share = error = None
    try:
        partition = make_partition(pack, group.size(), partition_path)
        if partition.hosts != group.size():
            raise PackError(f"{pack.path}: a shard of a {partition.hosts}-host partition, "
                            f"run by a group of {group.size()}")
        view, share = host_share(pack, partition, group.rank()), HostShare(partition, watch)
    except (ValueError, OSError) as e:
        error = e
    watch.all_ok(error, "opening its share of the model")
    layout = json.dumps([pack.model_type, pack.top_k,
                         [[l.index, l.num_experts, l.expert_bytes] for l in pack.layers]])
    watch.agree(layout, "the model (MoE layers, experts and their sizes)")
    watch.agree(share.partition.fingerprint, "the partition of the experts")
    return view, share
