"""A model on the hub from its headers alone (`edgemoe.doctor`): config.json and the
safetensors headers fetched with HTTP range requests, laid out as sparse files of the real
sizes, so the code that opens a local checkpoint sizes one without its weights."""

import fnmatch
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from .failures import one_line
from .fetch import fetch, listing
from .names import HubError, HubId, endpoint, offline, wanted

HEADER_FILES = ["config.json", "model.safetensors.index.json"]  # what doctor reads whole
MAX_HEADER_FILE_BYTES = 64 * 2**20  # config.json, the index: the largest real ones are ~10 MB
MAX_SAFETENSORS_HEADER = 100 * 2**20  # safetensors' own limit


@dataclass
class RemoteModel:
    """What `remote_headers` fetched: a folder of config.json and sparse safetensors files
    (real sizes, real headers, no weights), and the repository's files' sizes."""

    hub_id: HubId
    folder: Path
    commit: str
    files: List[Tuple[str, int]]  # every file a download would fetch, with its size
    fetched_bytes: int  # bytes this look-up read from the hub

    @property
    def download_bytes(self) -> int:
        return sum(size for _, size in self.files)


def remote_headers(hub_id: HubId, folder: Path) -> RemoteModel:
    """Fetch `hub_id`'s config.json (and safetensors index) and each weight file's header
    into `folder`: a header is read with two range requests (its length, then itself),
    and the file is written as that header followed by a hole up to the file's real size.
    Every size the hub declares is checked before the bytes it sizes are fetched."""
    from urllib.parse import quote

    if offline():
        raise HubError(f"{hub_id}: HF_HUB_OFFLINE is set; reading a model's headers on the "
                       f"hub needs the network (or download it, and pass its folder)")
    answered = False
    try:
        commit, sizes = listing(hub_id)
        answered = True
        weights = sorted(f for f in sizes if fnmatch.fnmatch(f, "model*.safetensors"))
        beside = [f for f in weights if "/" not in f]  # what mlx-lm loads: beside config.json
        if "config.json" not in sizes:
            raise HubError(f"{hub_id}: no config.json in the repository: not a model")
        if not beside:
            elsewhere = f" (only in subfolders: {', '.join(weights[:2])}; mlx-lm loads " \
                        f"those beside config.json)" if weights else ""
            raise HubError(f"{hub_id}: no safetensors weights (model*.safetensors) beside "
                           f"config.json in the repository{elsewhere}")
        folder.mkdir(parents=True, exist_ok=True)
        fetched = 0

        def get(name, limit, first=None, last=None):
            nonlocal fetched
            url = f"{endpoint()}/{hub_id.repo}/resolve/{commit}/{quote(name)}"
            data = fetch(hub_id, name, url, limit, first, last)
            fetched += len(data)
            return data

        for name in HEADER_FILES:
            if name not in sizes:
                continue
            if sizes[name] > MAX_HEADER_FILE_BYTES:
                raise HubError(f"{hub_id}: {name}: the hub lists {sizes[name]} bytes, more "
                               f"than a {name} can take ({MAX_HEADER_FILE_BYTES}); refused "
                               f"before fetching it")
            (folder / name).write_bytes(get(name, MAX_HEADER_FILE_BYTES))
        for name in beside:
            size = sizes[name]
            raw = get(name, 8, 0, 7)
            if len(raw) < 8:
                raise HubError(f"{hub_id}: {name}: {len(raw)} bytes where its header's "
                               f"length should be; damaged")
            (n,) = struct.unpack("<Q", raw)
            if n > min(MAX_SAFETENSORS_HEADER, max(size - 8, 0) if size else n) or n < 2:
                raise HubError(f"{hub_id}: {name}: its header claims {n} bytes in a file of "
                               f"{size} (safetensors allows {MAX_SAFETENSORS_HEADER}): damaged; "
                               f"refused before fetching it")
            header = get(name, n, 8, 8 + n - 1)
            if len(header) != n:
                raise HubError(f"{hub_id}: {name}: the hub sent {len(header)} bytes of its "
                               f"{n}-byte header; damaged or cut")
            with open(folder / name, "wb") as f:
                f.write(raw + header)
                f.truncate(size or 8 + n)  # a hole: no disk used for the weights
    except Exception as e:
        raise one_line(hub_id, e, answered) from e
    files = [(f, s) for f, s in sizes.items() if wanted(f)]
    return RemoteModel(hub_id, folder, commit, files, fetched)


def remote_config(model: RemoteModel) -> dict:
    return json.loads((model.folder / "config.json").read_text())
