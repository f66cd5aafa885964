"""Models named by a Hugging Face hub id (`org/name`, or `org/name@revision`).

Every tool's `--model` (and `edgemoe.load`) takes a local model folder or a hub id. A hub
id is downloaded once with huggingface_hub into the user's hub cache (HF_HOME, or
HF_HUB_CACHE), only the files a model needs (config, tokenizer, safetensors weights and
their index, chat template; a pack's experts file and trained assets), then run in place
as any local folder. huggingface_hub does the work: resumable downloads (an interrupted
file continues from its `.incomplete` part), a progress bar, `HF_TOKEN`, `HF_ENDPOINT`,
and `HF_HUB_OFFLINE=1` (the cache only). What edgemoe adds: the disk space is checked
against the files' sizes before any download, and the expected failures are one line.

`remote_headers` is the other way in, for `edgemoe.doctor`: config.json and the
safetensors headers only (HTTP range requests), laid out in a temporary folder as sparse
files of the real sizes, so that the same code that opens a local checkpoint sizes one
on the hub without downloading its weights.

Every byte edgemoe itself asks the hub for goes through `fetch`: one call with a deadline
(EDGEMOE_HUB_TIMEOUT seconds without a byte, default 10 as huggingface_hub's own; the
whole call within EDGEMOE_HUB_DEADLINE, default 120) and a limit on its size, checked
against what the hub declares (a listing's size, a Content-Length, a header's length
field) before the body is read. huggingface_hub's own downloads run under the same
per-read timeout. A call that stalls says which file stalled and after how many bytes;
a hub that never answered is "cannot be reached".

Here, the face of the package: `resolve` and what the tools ask for. By job: names.py (hub
ids, the endpoint, the cache, the timeouts), download.py, fetch.py (every byte edgemoe
asks for), failures.py (their one-line errors), remote.py (doctor's look from the headers).
"""

from .download import download, free_bytes, resolve
from .failures import Stalled
from .names import ALLOW_PATTERNS, HubError, HubId, cache_dir, parse_hub_id
from .remote import RemoteModel, remote_config, remote_headers

__all__ = ["ALLOW_PATTERNS", "HubError", "HubId", "RemoteModel", "Stalled", "cache_dir",
           "download", "free_bytes", "parse_hub_id", "remote_config", "remote_headers",
           "resolve"]
