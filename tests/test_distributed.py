"""Several hosts as one (edgemoe.distributed): processes on 127.0.0.1 joined by MLX's ring.

Each group is launched as users launch it (mlx.launch --backend ring), and held to one
host in this process, bit for bit: tokens, and the logits of every step. Each host must
have read only experts it owns. A host that dies or stops answering must make the other
exit with one clear line within 10 s.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edgemoe.convert import convert
from edgemoe.distributed import Partition, make_partition, parse_shard
from edgemoe.format.pack import Pack, PackError
from edgemoe.format.source import BUNDLED_MODEL

from conftest import error_line, tool_module

HERE = Path(__file__).parent
WORKER = HERE / "distributed_worker.py"
PYTHON = sys.executable
LAUNCH = Path(PYTHON).parent / "mlx.launch"


def _worker():
    spec = importlib.util.spec_from_file_location("distributed_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port_base(n: int) -> int:
    """A first port of `n` free consecutive ports."""
    while True:
        base = int(np.random.randint(20000, 60000))
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def launch(runs, tmp: Path, hosts: int = 2, timeout: int = 240):
    """Run the worker's `runs` on a group of `hosts` processes started by mlx.launch."""
    spec = tmp / f"runs-{len(list(tmp.glob('runs-*')))}.json"
    spec.write_text(json.dumps(runs))
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1",
                           "-n", str(hosts), "--starting-port", str(free_port_base(hosts)),
                           "--python", PYTHON, "--", str(WORKER), str(spec)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp)
    # (mlx.launch exits with 0 whatever its hosts did; it says when one failed)
    assert "exited with code" not in done.stderr and "was killed" not in done.stderr, \
        done.stdout[-2000:] + done.stderr[-4000:]
    return done


def alone(runs):
    worker = _worker()
    for spec in runs:
        worker.run(spec, None)


def check_same(single: Path, group: Path, hosts: int = 2):
    ref = np.load(f"{single}.0.npz")
    seen = np.zeros_like(ref["reads"][:0])
    for rank in range(hosts):
        got = np.load(f"{group}.{rank}.npz")
        assert got["tokens"].tolist() == ref["tokens"].tolist(), (rank, group)
        assert np.array_equal(got["logits"], ref["logits"]), \
            (rank, group, float(np.abs(got["logits"] - ref["logits"]).max()))
        position = {layer: i for i, layer in enumerate(got["layers"].tolist())}
        reads = got["reads"]
        assert len(reads), "a host read nothing: the budget does not exercise streaming"
        owned = got["owned"]
        assert all(owned[position[l], e] for l, e in reads.tolist()), \
            f"host {rank} read another host's expert"
        assert owned.sum() < owned.size  # a share, not every expert
        seen = np.concatenate([seen, reads])
    return seen


@pytest.fixture(scope="module")
def shards(checkpoints, tmp_path_factory):
    """mixtral's pack, and its two hosts' shards (convert --shard i/2)."""
    out = tmp_path_factory.mktemp("shards")
    mlx = checkpoints["mixtral"][1]
    for i in range(2):
        convert(mlx, out / f"mixtral-shard{i}", shard=f"{i}/2")
    return out


def test_two_hosts_equal_one(checkpoints, packs, shards, tmp_path):
    """One group, launched once, runs each case; each equals one host's run bit for bit
    (tokens and logits), and each host read only its own experts. Native in place and
    from packs (mixtral: each host its own shard), advisory (held to native), and the
    bundled model's prerouted routing (its heads run on every host alike), and experts
    shared out by a routing trace (--partition)."""
    cases = []  # (name, the group's model, its routing, the one host's model and routing)
    for family in ("qwen3_moe", "mixtral"):
        mlx, pack = checkpoints[family][1], packs[family]["mlx"]
        cases += [(f"{family}-inplace", mlx, "native", mlx, "native"),
                  (f"{family}-advisory", mlx, "advisory", mlx, "native"),
                  (f"{family}-pack", shards / "mixtral-shard{rank}" if family == "mixtral"
                   else pack, "native", pack, "native")]
    cases.append(("bundled-prerouted", BUNDLED_MODEL, "prerouted", BUNDLED_MODEL,
                  "prerouted"))
    mlx = checkpoints["qwen3_moe"][1]
    cases.append(("qwen3_moe-partition", mlx, "native", mlx, "native"))
    half = checkpoints["qwen3_moe_bf16"][1]  # bfloat16 activations: all_sum of bf16 rows
    cases.append(("qwen3_moe_bf16-inplace", half, "native", half, "native"))
    trace = _skewed_trace(Pack.open(packs["qwen3_moe"]["mlx"]), tmp_path / "trace.npz")
    budget = lambda name: 0.25 if name.startswith("bundled") else 0.5
    # the pack's heads routing every layer but the first: the shipped default's
    # cache-conditional layers route among each host's slots, which a group has more of
    from edgemoe.routing.between import plain_heads
    plain = str(plain_heads(BUNDLED_MODEL / "prerouter", tmp_path / "heads"))
    heads = lambda name: plain if name.startswith("bundled") else None
    launch([{"model": str(m), "budget": budget(n), "routing": r, "out": str(tmp_path / f"g-{n}"),
             "partition": str(trace) if n.endswith("partition") else None,
             "prerouter": heads(n)}
            for n, m, r, _, _ in cases], tmp_path)
    alone([{"model": str(m), "budget": budget(n), "routing": r, "out": str(tmp_path / f"s-{n}"),
            "prerouter": heads(n)}
           for n, _, _, m, r in cases])
    for name, *_ in cases:
        check_same(tmp_path / f"s-{name}", tmp_path / f"g-{name}")
    dealt = Partition.balanced(Pack.open(packs["qwen3_moe"]["mlx"]), 2, np.load(trace))
    for rank in range(2):
        got = np.load(tmp_path / f"g-qwen3_moe-partition.{rank}.npz")
        assert [dealt.owned(rank)[l].tolist() for l in got["layers"].tolist()] == \
            got["owned"].tolist()
        assert got["owned"].tolist() != \
            np.load(tmp_path / f"g-qwen3_moe-inplace.{rank}.npz")["owned"].tolist()


def _skewed_trace(pack, path: Path) -> Path:
    """A routing trace where a few experts take most rows (as edgemoe.generate --trace
    writes one)."""
    layers = [l.index for l in pack.layers]
    n = pack.layers[0].num_experts
    weights = np.arange(n, 0, -1, dtype=float) ** 2
    routed = np.random.default_rng(1).choice(n, size=(300, len(layers), pack.top_k),
                                             p=weights / weights.sum())
    np.savez(path, layers=np.array(layers), routed=routed, decode=np.ones(300, bool))
    return path


def _start_pair(tmp_path: Path, model, *flags):
    base = free_port_base(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    procs = []
    for rank in range(2):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        procs.append(subprocess.Popen(
            [PYTHON, "-m", "edgemoe.generate", "--distributed", "--model", str(model),
             "--max-tokens", "100000", "--expert-budget", "0.5", "--ignore-chat-template",
             "--prompt", "hello", *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path))
    os.set_blocking(procs[0].stdout.fileno(), False)
    deadline = time.monotonic() + 120
    while not (procs[0].stdout.read(64) or b""):  # host 0 streams text: decoding began
        assert procs[0].poll() is None, procs[0].stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the group never started decoding"
        time.sleep(0.2)
    return procs


def _ends_with_error(proc, within_s: float) -> str:
    tic = time.monotonic()
    try:
        proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the other host still ran {within_s} s after its peer was lost")
    assert proc.returncode != 0
    last = proc.stderr.read().decode().strip().splitlines()[-1]
    assert time.monotonic() - tic < within_s
    return last


def test_killed_host_stops_the_other(checkpoints, tmp_path):
    procs = _start_pair(tmp_path, checkpoints["qwen3_moe"][1])
    procs[1].kill()
    last = _ends_with_error(procs[0], 10)
    assert last.startswith("edgemoe.generate: error: host 0 (127.0.0.1:") and \
        "lost host 1 (127.0.0.1:" in last, last


def test_silent_host_times_out(checkpoints, tmp_path):
    """A host that stops answering (here: stopped) is given --group-timeout seconds. (5,
    not less: the group must also form within it, and a loaded machine starts one host's
    Python seconds after the other's.)"""
    procs = _start_pair(tmp_path, checkpoints["qwen3_moe"][1], "--group-timeout", "5")
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        last = _ends_with_error(procs[0], 15)
    finally:
        os.kill(procs[1].pid, signal.SIGKILL)
    assert "no answer from host 1 (127.0.0.1:" in last and "--group-timeout" in last, last


def test_group_that_never_forms(checkpoints, tmp_path):
    """Host 1 never starts: host 0 gives up after --group-timeout, with one line."""
    base = free_port_base(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    tic = time.monotonic()
    done = subprocess.run([PYTHON, "-m", "edgemoe.generate", "--distributed", "--model",
                           str(checkpoints["qwen3_moe"][1]), "--group-timeout", "2"],
                          env={**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and time.monotonic() - tic < 30
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("edgemoe: error: host 0: the group of 2 hosts (127.0.0.1:") and \
        "did not come up within 2 s (--group-timeout)" in last, last


def test_wrong_shard_fails_every_host(shards, tmp_path):
    """Both hosts given host 0's shard: host 1 says why, host 0 names host 1."""
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps([{"model": str(shards / "mixtral-shard0"), "budget": 0.5,
                                 "routing": "native", "out": str(tmp_path / "x")}]))
    done = subprocess.run([str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
                           "--starting-port", str(free_port_base(2)), "--python", PYTHON,
                           "--", str(WORKER), str(spec)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "the shard of host 0 of 2, run as host 1 of 2" in done.stderr, done.stderr[-3000:]
    assert "host 1 (127.0.0.1:" in done.stderr and "failed opening its share" in done.stderr


def test_shard_packs(checkpoints, shards, tmp_path, capsys):
    """A shard holds its host's records only, says whose it is, and is refused alone."""
    whole = Pack.open(convert(checkpoints["mixtral"][1], tmp_path / "whole"))
    parts = [Pack.open(shards / f"mixtral-shard{i}") for i in range(2)]
    for i, part in enumerate(parts):
        assert (part.shard["index"], part.shard["hosts"]) == (i, 2)
        for layer, full in zip(part.layers, whole.layers):
            assert layer.owned.tolist() == [e % 2 == i for e in range(full.num_experts)]
        assert part.experts_path.stat().st_size < whole.experts_path.stat().st_size
    assert sum(p.expert_bytes for p in parts) == whole.expert_bytes
    tool_module("verify").main(["--model", str(shards / "mixtral-shard1")])
    assert f"ok ({sum(l.num_owned for l in parts[1].layers)} expert records" in \
        capsys.readouterr().out
    generate = tool_module("generate")
    message = error_line(generate.main, "--model", shards / "mixtral-shard1", "-m", "1")
    assert "holds host 1's share of 2; run it with its group (--distributed" in message
    convert_tool = tool_module("convert")
    for argv, expected in ((["--shard", "2/2"], "--shard 2/2: the host i of N is counted"),
                           (["--shard", "x"], "--shard 'x': expected i/N"),
                           (["--partition", "t.npz"], "--partition: only with --shard")):
        message = error_line(convert_tool.main, "--hf-path", checkpoints["mixtral"][1],
                             "--mlx-path", tmp_path / "bad", *argv)
        assert expected in message, message
        assert not (tmp_path / "bad").exists()


def test_partitions(packs):
    pack = Pack.open(packs["mixtral"]["mlx"])
    rr = Partition.round_robin(pack, 2)
    assert all(o.tolist() == [e % 2 for e in range(len(o))] for o in rr.owners.values())
    # a skewed trace: experts 0 and 2 take most rows, so round-robin gives host 0 most work
    n, layers = pack.layers[0].num_experts, [l.index for l in pack.layers]
    rng = np.random.default_rng(0)
    routed = rng.choice(n, size=(400, len(layers), 2),
                        p=np.array([8, 1, 8, 1, 1, 1, 1, 1]) / 22)
    trace = {"layers": np.array(layers), "routed": routed}
    balanced = Partition.balanced(pack, 2, trace)

    def load(partition):
        rows = [np.bincount(partition.owners[l][routed[:, i].reshape(-1)], minlength=2)
                for i, l in enumerate(layers)]
        return max(r.max() / r.sum() for r in rows)

    assert load(balanced) < 0.55 < load(rr)
    for owner in balanced.owners.values():  # as many experts each
        assert np.bincount(owner, minlength=2).tolist() == [n // 2, n // 2]
    assert balanced.fingerprint != rr.fingerprint
    shard = Partition.from_shard(balanced.shard_info(1))
    assert shard.fingerprint == balanced.fingerprint
    assert make_partition(pack, 2).fingerprint == rr.fingerprint
    with pytest.raises(ValueError, match="recorded on another model"):
        Partition.balanced(pack, 2, {"layers": np.array(layers[1:]), "routed": routed[:, 1:]})
    assert parse_shard("1/4") == (1, 4)
    with pytest.raises(PackError, match="lacks expert"):
        from edgemoe.distributed import host_share
        half = host_share(pack, rr, 0)
        host_share(half, rr, 1)


def _serve(model, port: int, env=None, *flags):
    return subprocess.Popen([PYTHON, "-m", "edgemoe.server", "--model", str(model),
                             "--port", str(port), "--log-level", "WARNING", *flags],
                            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _wait_ready(port: int, procs, deadline_s: float = 120):
    import httpx

    deadline = time.monotonic() + deadline_s
    while True:
        for p in procs:
            assert p.poll() is None, p.stderr.read()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server never came up"
        time.sleep(0.3)


def test_group_server_answers_as_one_host(checkpoints, tmp_path):
    """`edgemoe.server --distributed` on two hosts: host 0 serves; concurrent requests (a
    batch) give one host's text and logprobs, and a stream cancelled midway (a shared
    cancellation) leaves the group in step for the next request."""
    import concurrent.futures as cf

    import openai

    model = checkpoints["qwen3_moe"][1]
    base = free_port_base(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    one_port, group_port = free_port_base(1), free_port_base(1)
    procs = [_serve(model, one_port, None, "--expert-budget", "0.25")]
    procs += [_serve(model, group_port, {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
                     "--distributed", "--expert-budget", "0.5") for r in range(2)]
    try:
        _wait_ready(one_port, procs)
        _wait_ready(group_port, procs)
        prompts = [("hello there", 12), ("the quick brown fox", 20), ("one two three", 8),
                   ("a b c d e f", 16)]

        def ask(port, prompt, n):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
            r = client.completions.create(model=str(model), prompt=prompt, max_tokens=n,
                                          temperature=0, logprobs=1)
            return r.choices[0].text, r.choices[0].logprobs.token_logprobs

        answers = {}
        for port in (one_port, group_port):
            with cf.ThreadPoolExecutor(len(prompts)) as pool:
                answers[port] = list(pool.map(lambda p: ask(port, *p), prompts))
        assert answers[group_port] == answers[one_port]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{group_port}/v1", api_key="-")
        stream = client.completions.create(model=str(model), prompt="hello there",
                                           max_tokens=500, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        assert ask(group_port, *prompts[1]) == answers[one_port][1]
    finally:
        for p in procs[:2]:  # the leaders; host 1 follows host 0's stop
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    assert procs[2].returncode == 0, procs[2].stderr.read()[-2000:]  # host 1 followed the stop
