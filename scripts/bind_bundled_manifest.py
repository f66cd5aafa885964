"""Bind the bundled pack's manifest (edgemoe/models/fine/manifest.json) as convert binds a
pack it writes: each record's checksum bound to its layer, expert and tensor layout, and
`files` with the SHA-256 of the tokenizer files, generation config and chat template.

Run it after a deliberate change to one of those files (the pack then refuses to open,
naming the file, until it is); the records, weights and the pack's fingerprint are
unchanged. Its assets (prerouter/, adapter/, traces, notes) were not written by convert
and are not listed.

    python scripts/bind_bundled_manifest.py
"""

import hashlib
import json

from edgemoe.format.pack import MANIFEST, Pack
from edgemoe.format.source import BUNDLED_MODEL

HASHED = ("chat_template.jinja", "generation_config.json", "tokenizer.json",
          "tokenizer_config.json")
UNHASHED = ("config.json", "experts.bin", "model.safetensors")  # checked by their own sums


def main():
    path = BUNDLED_MODEL
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.pop("files", None)
    for layer in manifest["layers"]:
        layer["records"] = [r[:3] for r in layer["records"]]
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))  # unbound: opens as it is
    pack = Pack.open(path)
    for entry, layer in zip(manifest["layers"], pack.layers):
        entry["records"] = layer.to_json()["records"]  # with each record's bound checksum
    files = {name: None for name in UNHASHED}
    files.update({name: hashlib.sha256((path / name).read_bytes()).hexdigest()
                  for name in HASHED})
    manifest["files"] = dict(sorted(files.items()))
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    bound = Pack.open(path)
    assert bound.bound and bound.fingerprint == pack.fingerprint
    print(f"bound {path / MANIFEST}: {sum(l.num_experts for l in bound.layers)} records, "
          f"{len(HASHED)} files checksummed")


if __name__ == "__main__":
    main()
