"""Will a pack (or an mlx-lm checkpoint read in place) run here, in how much memory, and how fast: from its manifest and a
short calibration of this machine's disk and compute. Reads no weights.

    python -m edgemoe.doctor [--model PACK] [--memory 16GB] [--expert-budget 25%] [--trace T.npz]

Predicted decode time per token, at a budget with a hit rate h:

    MoE layers x top-k x (one expert's compute)       gather_qmm on random arrays
  + resident compute (resident bytes less embeddings, at the experts' weight rate)
  + (1 - h) x top-k x expert bytes per layer / disk read rate

The store reads a miss while compute waits, so the terms add; a reader that overlaps
reads with compute could approach the larger of the two, also printed.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .calibrate import (DISK_RECORDS, calibrate_disk, decoder_layer_seconds,
                        expert_compute_seconds, layer_overhead_seconds, resident_compute_bytes)
from .cli import tool, tool_parser
from .format.pack import Pack, PackLayer
from .format.source import BUNDLED_MODEL, open_source, pack_asset
from .mlx_backend.families import find_experts, model_args
from .hub import ALLOW_PATTERNS, cache_dir as hub_cache_dir, free_bytes, parse_hub_id, remote_headers
from .options import StreamOptions
from .streaming.budget import (AUTO, AUTO_KV_TOKENS, HEADROOM, BudgetError, SlotPlan,
                               fitting_budget, fmt_bytes, parse_budget)
from .streaming.telemetry import available_memory_bytes
from .streaming.cache import DEFAULT_POLICY

BUDGETS = ("min", "10%", "25%", "50%", "100%")


@dataclass
class Prediction:
    compute_s: float  # per token
    read_s: float  # per token, at the hit rate

    @property
    def serial_tps(self) -> float:
        return 1 / (self.compute_s + self.read_s)

    @property
    def overlapped_tps(self) -> float:
        return 1 / max(self.compute_s, self.read_s)


def predict(pack: Pack, step_s: float, disk_rate: float, hit_rate: float,
            overhead_s: float = 0.0) -> Prediction:
    """`step_s`: a fully resident decode step; edgemoe adds a host round trip per MoE
    layer and the reads of its misses."""
    k = pack.top_k
    compute = step_s + overhead_s * len(pack.layers)
    read = (1 - hit_rate) * k * sum(l.expert_bytes for l in pack.layers) / disk_rate
    return Prediction(compute, read)


def replay_hit_rate(trace: dict, pack: Pack, budget_bytes: int) -> float:
    from .whatif.replay import simulate

    return simulate(trace, budget_bytes, DEFAULT_POLICY, pack.layers[0].num_experts,
                    learned=pack_asset(pack.path, "cache_policy")).decode_hit_rate


MAX_MEMORY = 2**60  # 1 EiB: more than any machine


def parse_memory(text: str) -> int:
    """Bytes of a --memory: a bare number of GB (16), or a size (16GB, 12GiB); a
    ValueError naming it otherwise (a percentage, two dots, a size no machine has)."""
    shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
    expected = "a size of memory: a number of GB (16) or a size (16GB, 12GiB)"
    if "%" in text:
        raise ValueError(f"--memory {shown}: {expected}, not a percentage (a share of what? "
                         f"--expert-budget takes one)")
    try:
        if re.fullmatch(r"\s*[0-9]+(\.[0-9]+)?\s*", text):
            value = float(text) * 1e9  # a bare number is in GB
        elif re.fullmatch(r"\s*[0-9]+(\.[0-9]+)?\s*[A-Za-z]+\s*", text):
            value = float(parse_budget(text, 0))
        else:
            value = float("nan")
    except (BudgetError, OverflowError):
        value = float("nan")
    if not 1 <= value <= MAX_MEMORY:  # (nan too)
        raise ValueError(f"--memory {shown}: expected {expected}, up to 1 EiB")
    return int(value)


@tool("doctor")
def main(argv=None):
    p = argparse.ArgumentParser(
        description="Will a model fit, and how fast will it decode? A model on the Hugging "
                    "Face hub is sized from its config.json and safetensors headers alone, "
                    "before any download.")
    p.add_argument("--model", default=str(BUNDLED_MODEL),
                   help="An edgemoe pack or an mlx-lm quantized checkpoint: a folder, or a "
                        "hub id (org/name[@revision]) (default: the bundled model)")
    p.add_argument("--memory", default=None,
                   help="Memory to run in: GB (16) or a size (16GB, 12GiB) (default: what "
                        "is available here)")
    StreamOptions.add_arguments(p, only=["expert_budget"])
    p.add_argument("--budget", dest="expert_budget", help=argparse.SUPPRESS)  # older name
    p.add_argument("--trace", default=None,
                   help="A routing trace (.npz) of this model: hit rates from replaying it")
    p.add_argument("--machine", default=None, metavar="PROFILE",
                   help="Forecast for another machine instead (edgemoe/whatif/twin/profiles.json: "
                        "m4-pro-24gb, m4-max-128gb, m3-max-48gb, m4-air-24gb, ...): fit, auto "
                        "budget, decode tok/s and TTFT per routing mode, labelled a forecast; "
                        "--model may also name a twin shape (qwen3-30b-a3b, ...)")
    p.add_argument("--measure-machine", default=None, metavar="OUT.json",
                   help="Measure this machine (SSD per record size and queue depth, int4 "
                        "matmul, host sync, our Python's speed) into a profile that "
                        "--machine OUT.json forecasts from, and that you can share "
                        "(docs/mac.md, \"Your Mac's profile\")")
    p.add_argument("--measure-mb", type=int, default=1024, help=argparse.SUPPRESS)
    args = tool_parser(p, "doctor").parse_args(argv)
    if args.memory:  # a bad one: one line, before any work
        parse_memory(args.memory)
    if args.measure_machine:  # edgemoe.whatif.twin.measure
        from .whatif.twin.measure import measure_machine
        prof = measure_machine(Path(args.measure_machine), megabytes=args.measure_mb)
        for k, f in prof.figures.items():
            print(f"  {k:>15} {f['value']:>10} {f['unit']}")
        print(f"wrote {args.measure_machine}: forecast from it with python -m edgemoe.doctor "
              f"--machine {args.measure_machine} --model qwen3-30b-a3b")
        return prof
    if args.machine:  # edgemoe.whatif.twin.forecast: analytic, from the twin's parts
        from .whatif.twin.forecast import report as forecast
        budgets = [args.expert_budget] if args.expert_budget not in (None, AUTO) else None
        memory = parse_memory(args.memory) if args.memory else None
        return forecast(args.model, args.machine, budgets, args.trace, memory)
    hub_id = parse_hub_id(args.model)
    if hub_id is not None:
        cached = cached_snapshot(hub_id)
        if cached is None:  # not downloaded: size it from its headers
            return report_remote(hub_id, args)
        args.model = str(cached)
    pack = open_source(args.model, find_experts=find_experts)
    trace = None
    if args.trace:
        from .streaming.trace import check_trace_matches, load_trace

        trace = load_trace(args.trace)
        check_trace_matches(trace, pack, args.trace)
    report(pack, args, trace)


def cached_snapshot(hub_id):
    """The folder of `hub_id` in the hub cache, when a download completed it; else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(hub_id.repo, revision=hub_id.revision,
                                        allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except Exception:  # not there (or partly): huggingface_hub's errors
        return None
    return folder if (folder / "config.json").exists() else None


def report_remote(hub_id, args):
    """Whether a model on the hub fits here (or in --memory), from its config.json and
    safetensors headers, read into a temporary folder of sparse files (edgemoe.hub)."""
    if args.trace:
        raise ValueError("--trace with a hub id: replay a trace against a downloaded model")
    with headers_folder() as tmp:
        remote = remote_headers(hub_id, tmp / "model")
        try:
            pack = open_source(remote.folder, verify=False, find_experts=find_experts)
        except ValueError as e:  # name the repository, not the temporary folder
            raise ValueError(str(e).replace(str(remote.folder), str(hub_id))) from None
        config = json.loads((remote.folder / "config.json").read_text())
        print(f"hub: {hub_id} at {remote.commit[:12]}, sized from config.json and the "
              f"safetensors headers ({fmt_bytes(remote.fetched_bytes)} read, no weights "
              f"downloaded)")
        describe(pack, resident_compute_bytes(pack), hub_id)
        free = free_bytes(hub_cache_dir())
        need = remote.download_bytes
        print(f"  download         {fmt_bytes(need):>10}  ({len(remote.files)} files into "
              f"{hub_cache_dir()}, {fmt_bytes(free)} free: "
              + ("enough)" if need <= free else "NOT enough)"))
        memory, auto, no_fit = fit(pack, config, args)
        plan = SlotPlan.of(pack)
        print(f"  {'budget':>10} {'slots':>5} {'memory':>10}")
        for b in _budgets(args, auto):
            budget_bytes = plan.minimum_bytes if b == "min" else parse_budget(b, pack.expert_bytes)
            slots = plan.slots_for_bytes(budget_bytes)
            label = b if isinstance(b, str) else fmt_bytes(b)
            if slots < pack.top_k:
                print(f"  {str(label):>10} below the minimum budget")
                continue
            print(f"  {label:>10} {slots:>5} "
                  f"{fmt_bytes(pack.resident_bytes + plan.memory(slots)):>10}")
        print_fit(pack, args, memory, auto, no_fit)
        print(f"speed: not predicted from headers (doctor times reads of the model's own "
              f"files); once downloaded (edgemoe.generate --model {hub_id}), run doctor on "
              f"it again")


TEMP_PREFIX = "edgemoe-doctor-"
TEMP_MARK = ".edgemoe-doctor"  # in every folder doctor makes: only those are ever removed


@contextlib.contextmanager
def headers_folder():
    """A temporary folder for a hub model's headers, named for this process: removed at
    the end, on SIGTERM too; one a killed doctor left (its process gone) is removed by
    the next doctor run."""
    remove_stale_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-"))
    (folder / TEMP_MARK).touch()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    except ValueError:  # not the main thread: the next run cleans up after a kill
        previous = None
    try:
        yield folder
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(folder, ignore_errors=True)


def _exit_on_sigterm(*_):
    raise SystemExit("edgemoe.doctor: terminated")


def remove_stale_folders():
    """Remove the temporary folders of doctor runs whose process is gone."""
    for folder in Path(tempfile.gettempdir()).glob(TEMP_PREFIX + "*"):
        owner = re.match(re.escape(TEMP_PREFIX) + r"(\d+)-", folder.name)
        if owner and (folder / TEMP_MARK).exists() and not _alive(int(owner[1])):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def fit(pack: Pack, config: dict, args):
    """(memory, the budget `--expert-budget auto` gives there or None, why not)."""
    memory = parse_memory(args.memory) if args.memory else available_memory_bytes()
    try:  # the rule `--expert-budget auto` follows
        return memory, fitting_budget(pack, config, memory,
                                      model_args=model_args(config)), None
    except BudgetError as e:
        return memory, None, str(e)


def print_fit(pack: Pack, args, memory: int, auto, no_fit):
    where = f"--memory {args.memory}" if args.memory else "available here"
    if auto is None:
        print(f"memory {fmt_bytes(memory)} ({where}): {no_fit}")
    else:
        plan = SlotPlan.of(pack)
        print(f"memory {fmt_bytes(memory)} ({where}): fits: --expert-budget auto gives "
              f"{auto} bytes ({fmt_bytes(auto)}, {auto / pack.expert_bytes:.0%} of the routed "
              f"experts, {plan.slots_for_bytes(auto)} slots per layer), beside the resident "
              f"weights ({fmt_bytes(pack.resident_bytes)}), a {AUTO_KV_TOKENS}-token KV cache "
              f"and the runtime, {HEADROOM:.0%} kept free")


def _budgets(args, auto):
    asked = args.expert_budget if args.expert_budget not in (None, "1.0", AUTO) else None
    return list(BUDGETS) + ([asked] if asked else []) + ([auto] if auto else [])


def describe(pack: Pack, computed: int, name=None):
    """The model's sizes: what stays resident, what streams, the least it runs in."""
    layers, k = pack.layers, pack.top_k
    resident, experts = pack.resident_bytes, pack.expert_bytes
    minimum = SlotPlan.of(pack).minimum_bytes
    per_expert = sum(l.expert_bytes for l in layers) / len(layers)
    print(f"pack: {name or pack.path} ({pack.model_type}, {len(layers)} MoE layers, "
          f"{layers[0].num_experts} experts each, top-{k})")
    print(f"  total            {fmt_bytes(resident + experts):>10}")
    print(f"  resident         {fmt_bytes(resident):>10}  (model.safetensors; "
          f"{fmt_bytes(computed)} computed per token, the rest embedding lookups)")
    print(f"  routed experts   {fmt_bytes(experts):>10}  ({fmt_bytes(per_expert)} per expert)")
    print(f"  minimum budget   {fmt_bytes(minimum):>10}  ({minimum / experts:.1%} of the routed "
          f"experts: top-{k} slots in every MoE layer)")


def report(pack: Pack, args, trace=None):
    layers, k = pack.layers, pack.top_k
    resident, experts = pack.resident_bytes, pack.expert_bytes
    plan = SlotPlan.of(pack)
    minimum = plan.minimum_bytes
    per_expert = sum(l.expert_bytes for l in layers) / len(layers)
    computed = resident_compute_bytes(pack)
    describe(pack, computed)

    disk = calibrate_disk(pack)
    shapes = {}  # layers of the same record layout compute alike: time each layout once
    expert_s = [_cached(shapes, l) for l in layers]
    rate = per_expert * len(layers) / sum(expert_s)  # bytes of weights computed per second
    resident_s = computed / rate
    overhead_s = layer_overhead_seconds(pack)
    config = json.loads((pack.path / "config.json").read_text())
    layer_s, outside_s = decoder_layer_seconds(pack)
    step_s = layer_s * config["num_hidden_layers"] + outside_s
    hot = "hot" if disk.found_hot == DISK_RECORDS else "cold" if not disk.found_hot else "partly hot"
    print("calibration (this machine):")
    print(f"  disk     {DISK_RECORDS} reads of {fmt_bytes(disk.record_bytes)}: "
          f"{disk.cold_rate / 1e9:.2f} GB/s from disk (page cache dropped"
          + (f"; {disk.cold_hot} records stayed cached: optimistic" if disk.cold_hot else "")
          + f"), {disk.found_rate / 1e9:.2f} GB/s as found (page cache {hot}: "
            f"{disk.found_hot}/{DISK_RECORDS} records cached)")
    print(f"  compute  one expert {1e3 * statistics.mean(expert_s):.3f} ms "
          f"({rate / 1e9:.2f} GB/s of weights, gather_qmm fp32); "
          f"resident {1e3 * resident_s:.3f} ms/token")
    print(f"  host     {1e3 * overhead_s:.3f} ms per MoE layer (routing synced to the host, "
          f"slot table sent back)")
    print(f"  step     {1e3 * layer_s:.3f} ms per decoder layer, {1e3 * outside_s:.3f} ms per "
          f"token outside them (mlx-lm's model class, random weights): "
          f"{1e3 * step_s:.2f} ms per resident decode step")

    memory, auto, no_fit = fit(pack, config, args)
    budgets = _budgets(args, auto)
    print("predicted decode: a resident step, plus the host round trip per MoE layer, "
          "plus the misses read (serially, or overlapped with compute)")
    if args.trace:
        print(f"hit rates: {DEFAULT_POLICY} replay of {args.trace} (decode tokens)")
    else:
        print("hit rates: assumed slots / experts per layer, what any policy gets from a "
              "router that picks uniformly; a trained router reuses more (pass --trace)")
    print(f"  {'budget':>10} {'slots':>5} {'memory':>10} {'hit rate':>8} "
          f"{'read/token':>10} {'tok/s':>7} {'(reads overlapped)':>18}")
    for b in budgets:
        budget_bytes = minimum if b == "min" else parse_budget(b, experts)
        slots = plan.slots_for_bytes(budget_bytes)
        if slots < k:
            print(f"  {str(b):>10} below the minimum budget")
            continue
        slot_bytes = plan.memory(slots)
        hit = (replay_hit_rate(trace, pack, budget_bytes) if trace is not None
               else slots / layers[0].num_experts)
        pred = predict(pack, step_s, disk.cold_rate, hit, overhead_s)
        label = b if isinstance(b, str) else fmt_bytes(b)
        read = (1 - hit) * k * sum(l.expert_bytes for l in layers)
        print(f"  {label:>10} {slots:>5} {fmt_bytes(resident + slot_bytes):>10} {hit:>8.1%} "
              f"{fmt_bytes(read):>10} {pred.serial_tps:>7.1f} {pred.overlapped_tps:>18.1f}")
    print_fit(pack, args, memory, auto, no_fit)


def _cached(shapes: dict, layer: PackLayer) -> float:
    key = json.dumps([layer.to_json()["tensors"], layer.quantization], sort_keys=True)
    if key not in shapes:
        shapes[key] = expert_compute_seconds(layer)
    return shapes[key]


if __name__ == "__main__":
    main()
