"""Check every weight of a model folder against its checksums, reading it all once.

    python -m edgemoe.verify [--model PATH] [--rebuild]

A pack is checked against its manifest. An mlx-lm checkpoint read in place has no
checksums of its own: the first run computes them into `edgemoe.checksums.json` beside
it, after which loads check its weights as a pack's are and later runs check against
that index (`--rebuild` computes it again, for a checkpoint replaced on purpose).
"""

import argparse
import sys

from tqdm import tqdm

from .cli import tool, tool_parser
from .format.checksums import INDEX_FILE, build_index, expert_crc32s
from .format.pack import PackError
from .format.source import open_source
from .mlx_backend.families import find_experts


def check(pack, bar) -> int:
    """Verify resident tensors, then every record; the number of records checked."""
    pack.verify_resident()
    found = expert_crc32s(pack, bar.update)
    for layer in pack.layers:
        for e, (record, crc) in enumerate(zip(layer.records, found[layer.module])):
            if record is not None and record.crc32 != crc:  # (None: another host's)
                where = pack.files[record.segments[0][0]]
                raise PackError(f"{where}: layer {layer.index} expert {e}: checksum mismatch "
                                f"(expected {record.crc32:08x}, found {crc:08x})")
    return sum(l.num_owned for l in pack.layers)


@tool("verify")
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="An edgemoe pack or mlx-lm quantized checkpoint (default: the bundled "
                        "model)")
    p.add_argument("--rebuild", action="store_true",
                   help=f"For a checkpoint read in place: compute {INDEX_FILE} anew")
    args = tool_parser(p, "verify").parse_args(argv)
    pack = open_source(args.model, verify=not args.rebuild, find_experts=find_experts)
    indexing = pack.in_place and (args.rebuild or pack.resident_crc32 is None)
    bar = tqdm(total=pack.expert_bytes, unit="B", unit_scale=True,
               desc="indexing" if indexing else "verifying", file=sys.stderr)
    with bar:
        if indexing:
            index = build_index(pack, bar.update)
        else:
            records = check(pack, bar)
    if indexing:
        print(f"wrote {pack.path / INDEX_FILE}: checksums of "
              f"{sum(l.num_experts for l in pack.layers)} experts and "
              f"{len(index['resident'])} resident tensors; loads now verify them")
    else:
        print(f"{pack.path}: ok ({records} expert records, {len(pack.resident_crc32)} "
              f"resident tensors{_coverage(pack)})")


def _coverage(pack) -> str:
    """What a pack's manifest binds beyond each record's bytes; a note for an older one."""
    if pack.in_place:
        return ""
    hashed = sorted(n for n, sha in (pack.written or {}).items() if sha)
    note = []
    if pack.bound:
        note.append("records bound to their layer, expert and tensors")
    if hashed:
        note.append(f"{len(hashed)} files checksummed ({', '.join(hashed[:4])})")
    if pack.bound and hashed:
        return "; " + "; ".join(note)
    return ("; " + "; ".join(note) if note else "") + \
        ("; note: written before edgemoe bound records to their identity and checksummed "
         "its tokenizer files: swapped records or a changed tokenizer are not caught; "
         "convert the checkpoint again to check them")


if __name__ == "__main__":
    main()
