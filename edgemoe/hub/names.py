"""What names a model on the hub, and where edgemoe asks for it: hub ids (`org/name`,
`org/name@revision`), the files a model needs, the endpoint and the cache
(huggingface_hub's settings), and the timeouts every call runs under."""

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# the files mlx-lm's own loader fetches, less custom code (*.py): edgemoe runs mlx-lm's
# model classes only; and an edgemoe pack's own files
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "experts.bin", "cache_policy.npz",
                  "prerouter/*", "adapter/*"]
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)"
                      r"(?:@(?P<revision>[A-Za-z0-9_./-]+))?")



class HubError(ValueError):
    """An expected failure of a hub download: one line, naming the repository and the fix."""


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: Optional[str] = None  # None: the default branch

    def __str__(self):
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(name) -> Optional[HubId]:
    """The hub id `name` spells, or None when it names a local path (one that exists, or
    that cannot be a hub id: absolute, ./relative, more than one slash)."""
    if name is None or isinstance(name, Path):
        return None
    text = str(name)
    if os.path.exists(text) or text.startswith((".", "/", "~")):
        return None
    match = _REPO_ID.fullmatch(text)
    if match is None or ".." in match["repo"]:
        return None
    return HubId(match["repo"], match["revision"])


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def wanted(filename: str) -> bool:
    return any(fnmatch.fnmatch(filename, p) for p in ALLOW_PATTERNS)



def stall_seconds() -> float:
    return _seconds("EDGEMOE_HUB_TIMEOUT", 10.0)


def deadline_seconds() -> float:
    return _seconds("EDGEMOE_HUB_DEADLINE", 120.0)


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:
        raise HubError(f"{name}={text[:40]!r}: expected seconds, a number from 0 to 86400")
    return value
