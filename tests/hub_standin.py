"""A stand-in of the Hugging Face hub's HTTP API on loopback, for testing hub ids offline.

It serves what huggingface_hub asks for when it downloads a model or reads its headers:

    GET  /api/models/{repo}[/revision/{rev}]      repository info, siblings with sizes
    GET  /api/models/{repo}/tree/{rev}            the file listing (snapshot_download)
    HEAD /{repo}/resolve/{rev}/{file}             ETag, X-Repo-Commit, Content-Length
    GET  /{repo}/resolve/{rev}/{file}             the bytes; a Range gives 206

and fails as the hub does, with the X-Error-Code headers huggingface_hub reads
(RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound). Every request is logged
with the body bytes it served, so a test can count what a tool fetched. `cut` makes the
next download of a file stop after some bytes (a cut connection), `refused` makes its
downloads fail with 503 until cleared (`refuse_after_cut`: from its cut on).

    hub = HubStandin(); hub.add_repo("org/name", folder); hub.start()
    env HF_ENDPOINT=hub.url HF_HOME=tmp ...
"""

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional
from urllib.parse import unquote, urlparse


@dataclass
class Served:
    method: str
    path: str
    status: int
    range: Optional[str]
    body_bytes: int

    @property
    def filename(self) -> Optional[str]:
        m = re.match(r"/[^/]+/[^/]+/resolve/[^/]+/(.+)", self.path)
        return m[1] if m else None


class HubStandin:
    def __init__(self):
        self.repos: Dict[str, dict] = {}  # repo -> {"refs": {name: commit}, "commits": {}}
        self.gated = set()
        self.log: List[Served] = []
        self.cuts: Dict[str, int] = {}  # file -> bytes to send before cutting, once
        self.refused = set()  # files whose downloads answer 503
        self.refuse_after_cut = set()  # files refused once their cut was served
        self.claimed = {}  # (repo, commit, file) -> the size the API lists
        self.lock = threading.Lock()
        self.server = None

    # -- content --------------------------------------------------------------------
    def add_repo(self, repo: str, folder, branch: str = "main", gated: bool = False,
                 claimed_sizes: Optional[Dict[str, int]] = None) -> str:
        """Publish `folder`'s files as a new commit of `repo` on `branch`; its hash.
        `claimed_sizes`: sizes the API lists for some files instead of theirs (a repo
        larger than the disk, without the bytes)."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes()
                 for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for name, data in files.items():
            digest.update(name.encode() + hashlib.sha1(data).digest())
        commit = digest.hexdigest()
        entry = self.repos.setdefault(repo, {"refs": {}, "commits": {}})
        entry["commits"][commit] = files
        entry["refs"][branch] = commit
        self.claimed.update({(repo, commit, n): size for n, size in (claimed_sizes or {}).items()})
        if gated:
            self.gated.add(repo)
        return commit

    def bytes_served(self, predicate=lambda s: True) -> int:
        return sum(s.body_bytes for s in self.log if predicate(s))

    # -- server ---------------------------------------------------------------------
    def start(self) -> "HubStandin":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self):
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    # -- requests -------------------------------------------------------------------
    def _commit(self, repo: str, rev: str) -> Optional[str]:
        entry = self.repos[repo]
        if rev in entry["refs"]:
            return entry["refs"][rev]
        return rev if rev in entry["commits"] else None

    def _handle(self, h: BaseHTTPRequestHandler, head: bool):
        url = urlparse(h.path)
        path = unquote(url.path)
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?/?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = api[1] if api else resolve[1] if resolve else None
        if repo is None:
            return self._send(h, path, 404, {"X-Error-Code": "EntryNotFound"}, b"", head)
        if repo not in self.repos:
            return self._send(h, path, 404, {"X-Error-Code": "RepoNotFound",
                                             "X-Error-Message": "Repository not found"},
                              b'{"error": "Repository not found"}', head)
        if repo in self.gated and "authorization" not in {k.lower() for k in h.headers}:
            return self._send(h, path, 401, {"X-Error-Code": "GatedRepo",
                                             "X-Error-Message": "Access to this model is "
                                                                "restricted"},
                              b'{"error": "gated"}', head)
        rev = (api[3] if api and api[3] else "main") if api else resolve[2]
        commit = self._commit(repo, rev)
        if commit is None:
            return self._send(h, path, 404, {"X-Error-Code": "RevisionNotFound"},
                              b'{"error": "Invalid rev id"}', head)
        files = self.repos[repo]["commits"][commit]
        if api:
            if api[2] == "tree":
                body = [{"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d),
                         "path": n} for n, d in files.items()]
            else:
                body = {"id": repo, "modelId": repo, "sha": commit, "private": False,
                        "gated": "auto" if repo in self.gated else False, "tags": [],
                        "siblings": [{"rfilename": n,
                                      "size": self.claimed.get((repo, commit, n), len(d)),
                                      "blobId": hashlib.sha1(d).hexdigest()}
                                     for n, d in files.items()]}
            return self._send(h, path, 200, {"Content-Type": "application/json"},
                              json.dumps(body).encode(), head)
        name = resolve[3]
        if name not in files:
            return self._send(h, path, 404, {"X-Error-Code": "EntryNotFound"}, b"", head)
        if not head and name in self.refused:
            return self._send(h, path, 503, {}, b"unavailable", head)
        data = files[name]
        headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": commit,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        status, body, asked = 200, data, h.headers.get("Range")
        if asked:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", asked.strip())
            first = int(m[1])
            last = min(int(m[2]) if m[2] else len(data) - 1, len(data) - 1)
            status, body = 206, data[first:last + 1]
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        cut = None
        if not head:
            with self.lock:
                cut = self.cuts.pop(name, None)
                if cut is not None and name in self.refuse_after_cut:
                    self.refused.add(name)
        self._send(h, path, status, headers, body, head, asked, cut)

    def _send(self, h, path, status, headers, body: bytes, head: bool, asked=None, cut=None):
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        if cut is not None:
            h.send_header("Connection", "close")
        h.end_headers()
        sent = 0
        if not head:
            out = body if cut is None else body[:cut]
            try:
                h.wfile.write(out)
                h.wfile.flush()
                sent = len(out)
            except OSError:
                pass
            if cut is not None:
                h.close_connection = True
        with self.lock:
            self.log.append(Served(h.command, path, status, asked, sent))
