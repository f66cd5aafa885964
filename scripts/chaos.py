"""Chaos against one `edgemoe.server`: good and bad requests, stalled and vanishing clients,
and file faults at once, for a bounded time, on loopback only.

    python scripts/chaos.py [--model PACK] [--duration 180] [--json chaos.json]
    python scripts/chaos.py --probe-memory 16   # where memory goes, kind by kind

The server serves a copy of the pack (the faults are made in the copy): every
--fault-every seconds one byte of a random expert record is flipped for --fault-for
seconds, then restored. Meanwhile:
  good      greedy completions (plain and streamed), each checked token for token against
            the same prompt run alone before the chaos began; some ask for greedy by a
            limit (temperature 1e-39 or 1e-45, top_p 0 or 1e-300, top_k 1), which must
            give the same tokens;
  bad       requests the server must refuse with a 4xx (a poison top_k, NaN, wrong types,
            an oversized body, a foreign Host, text/plain, a deep or broken JSON, a
            schema deeper than llguidance's recursion limit on each API, a 3.9 MB
            Responses input, a function_call_output without call_id, a grammar bomb (a
            schema regex whose masks cost ~0.15 s a token: its row must end with a 400
            within its budget), ...);
  stalled   streamed requests from clients that never read (a 4 KB receive buffer);
  vanishing streamed requests whose clients hang up after a few chunks;
  poison    requests beside the good ones that would once have failed their whole batch
            (Ollama temperature 1e308 with format json, OpenAI repetition_penalty 1e-300
            with response_format, top_logprobs under a grammar): refused with a 400, or
            answered alone; a good request whose error names one is counted
            (good_failed_by_another);
  bombs     chat templates that loop for ever or build huge strings (the server runs with
            --allow-client-templates): each must be stopped and refused with a 400;
  slow      up to 256 connections that send headers, then a body a byte every 2 s:
            closed by the server's deadline, while /health and good requests go on;
  health    /health polled all along (its slowest answer is reported).

A good request may fail only with a 500 that names a corrupt record (a fault it met: the
server refused to compute on bad bytes); anything else that is not its solo output counts
as wrong, and one that does not finish within --request-timeout as a hang. The report:
requests sent by kind, good answered correctly, failed by a fault, wrong, hung; bad
refused with 4xx; 5xx count; p95 latency of good requests; server RSS before and after;
rows still active at the end; stalled streams the server cancelled for not reading; and
`checks`, each true or false: 0 wrong outputs, 0 hangs, every bad request refused, RSS
back within 10% of its start (less the prompt cache's bytes, which /metrics reports and
its flags bound: it holds the run's prompts on purpose), no worker stuck (the exit status is 1 when one is false).
/health may answer 503 while a fault fails every request (health_not_200).
"""

import argparse
import itertools
import json
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import start_server  # noqa: E402

from edgemoe.format.pack import Pack  # noqa: E402
from edgemoe.format.source import BUNDLED_MODEL  # noqa: E402

PROMPTS = ["def read_lines(path):", "import os\n\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "The module json", "# Copyright", "return sorted(",
           "with open(path) as f:"]
MAX_TOKENS = 24
SERVER_FLAGS = ["--max-batch", "4", "--send-timeout", "2", "--send-buffer", "16384",
                "--read-timeout", "10", "--expert-budget", "25%", "--allow-client-templates",
                "--template-timeout", "2", "--request-timeout", "5"]
MARKER = "CHAOS_POISON_MARKER"  # in every poison request: a good one's error must not name it
BOMBS = ["{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         "{% for i in range(100000) %}{% for j in range(100000) %}{{ '" + MARKER + "' }}"
         "{% endfor %}{% endfor %}",
         "{{ 'x' * 30000000 }}"]


def bad_requests(url: str):
    """(name, callable returning a status code): each must be refused with a 4xx."""
    post = f"{url}/v1/completions"

    def js(body, **kw):
        return lambda c: c.post(post, json=body, **kw).status_code

    def raw(content, ctype="application/json", **headers):
        return lambda c: c.post(post, content=content,
                                headers={"content-type": ctype, **headers}).status_code

    return [
        ("top_k >= vocabulary", js({"prompt": "x", "max_tokens": 4, "temperature": 1,
                                    "top_k": 10 ** 6})),
        ("temperature NaN", raw(b'{"prompt": "x", "max_tokens": 4, "temperature": NaN}')),
        ("min_p Infinity", raw(b'{"prompt": "x", "max_tokens": 4, "min_p": Infinity}')),
        ("seed 2**64", js({"prompt": "x", "max_tokens": 4, "seed": 2 ** 64})),
        ("max_tokens a string", js({"prompt": "x", "max_tokens": "many"})),
        ("prompt missing", js({"max_tokens": 4})),
        ("beyond the context", js({"prompt": "x", "max_tokens": 10 ** 6})),
        ("200 stop strings", js({"prompt": "x", "max_tokens": 4, "stop": ["a"] * 200})),
        ("5 MB body", raw(b'{"prompt": "' + b"x" * (5 * 2 ** 20) + b'"}')),
        ("a web page of another origin", raw(b'{"prompt": "x"}', "text/plain",
                                             origin="http://evil.example")),
        ("foreign Host", raw(b'{"prompt": "x"}', host="evil.example")),
        ("deep JSON", raw(b"[" * 100000 + b"]" * 100000)),
        ("broken JSON", raw(b'{"prompt": "x",')),
        ("lone surrogate", raw(b'{"prompt": "\\ud800", "max_tokens": 2}')),
        ("chat without messages", lambda c: c.post(f"{url}/v1/chat/completions",
                                                   json={"max_tokens": 2}).status_code),
        ("a 5000-digit integer", raw(b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")),
        ("ollama temperature 1e308 with format json", lambda c: c.post(
            f"{url}/api/generate", json={"model": "pack", "prompt": MARKER, "stream": False,
                                         "format": "json",
                                         "options": {"temperature": 1e308}}).status_code),
        ("repetition_penalty 1e-300 with response_format", lambda c: c.post(
            f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": MARKER}], "max_tokens": 8,
                "repetition_penalty": 1e-300, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "p", "schema": {
                        "type": "object", "properties": {MARKER: {"type": "string"}},
                        "required": [MARKER]}}}}).status_code),
        ("a model that does not exist", lambda c: _no_folder(c.post(post, json={
            "model": "nope", "prompt": "x", "max_tokens": 2}))),
        ("chat response_format 250 deep", lambda c: c.post(
            f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "d", "schema": _deep(250)}}}).status_code),
        ("responses text.format 250 deep", lambda c: c.post(f"{url}/v1/responses", json={
            "input": "hi", "max_output_tokens": 4, "text": {"format": {
                "type": "json_schema", "name": "d", "schema": _deep(250)}}}).status_code),
        ("ollama format 900 deep", lambda c: c.post(f"{url}/api/chat", json={
            "model": "pack", "stream": False, "format": _deep(900),
            "messages": [{"role": "user", "content": "hi"}]}).status_code),
        ("responses 3.9 MB input", lambda c: c.post(f"{url}/v1/responses", json={
            "input": "word " * (39 * 2 ** 20 // 50), "max_output_tokens": 4}).status_code),
        ("function_call_output without call_id", lambda c: c.post(
            f"{url}/v1/responses", json={"max_output_tokens": 2, "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "output": "42"}]}).status_code),
        ("grammar bomb", lambda c: _named(c.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": MARKER}], "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "bomb", "schema": GRAMMAR_BOMB}}}), "response_format")),
    ]


FLOOD_ADDRESS = "127.0.0.2" if sys.platform.startswith("linux") else "127.0.0.1"
GRAMMAR_BOMB = {"type": "string", "pattern": "^(a{700}){700}$"}
# bodies that may take longer than --request-timeout to send on a loaded machine: the
# server closing them is its deadline at work, not a failure
SLOW_TO_SEND = {"responses 3.9 MB input"}
RSS_SETTLE_S = 90  # how long the server's RSS may take to come back after the run
# sampling values whose limit is greedy: a good request may carry any of them
GREEDY_LIMITS = [{"temperature": 0}, {"temperature": 0}, {"temperature": 1e-39},
                 {"temperature": 1e-45}, {"temperature": 1, "top_p": 0},
                 {"temperature": 1, "top_p": 1e-300}, {"temperature": 1, "top_k": 1}]


def _deep(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _named(r, param: str):
    """A response's status, or 0 (not refused) when a 4xx does not name `param`, or
    FAULT for a 500 naming a corrupt record (an injected fault met it: the server
    refused to compute on bad bytes before the request's own error could show)."""
    if 400 <= r.status_code < 500 and r.json().get("error", {}).get("param") != param:
        return 0
    if r.status_code == 500 and "checksum mismatch" in r.text:
        return FAULT
    return r.status_code


FAULT = "failed by a fault"


def _no_folder(r) -> int:
    """A response's status, or 0 (not refused) when it shows the server's folders."""
    return 0 if "edgemoe-chaos-" in r.text else r.status_code


class Chaos:
    def __init__(self, url: str, pack: Path, args):
        self.url, self.pack, self.args = url, pack, args
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = Counter()
        self.latencies, self.health_s, self.wrong = [], [], []
        self.reference = {}
        self.fault_changes = 0  # flips and restores so far: odd while a fault is in place
        self.refused = Counter()
        self.rng = random.Random(args.seed)

    def client(self) -> httpx.Client:
        """A client that opens a connection for each request: one kept alive between
        requests may be closed by the server's keep-alive timeout as the next request
        goes out, a race of the client's (a ReadError on a loaded machine), not a
        failure of the server's."""
        return httpx.Client(timeout=self.args.request_timeout,
                            limits=httpx.Limits(max_keepalive_connections=0))

    def count(self, *keys):
        with self.lock:
            for k in keys:
                self.counts[k] += 1

    # -- good requests -------------------------------------------------------------
    def solo(self, client, prompt, stream, sampling=None):
        """(token ids, or None) and the failure, of one greedy completion (`sampling`:
        values whose limit is greedy)."""
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
                **(sampling or {})}
        if not stream:
            r = client.post(f"{self.url}/v1/completions", json=body)
            if r.status_code != 200:
                return None, r
            return [c["id"] for c in r.json()["choices"][0]["logprobs"]["content"]], r
        ids = []
        with client.stream("POST", f"{self.url}/v1/completions",
                           json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                return None, r
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return None, event["error"]["message"]
                for choice in event["choices"]:
                    ids += [c["id"] for c in (choice.get("logprobs") or {}).get("content", [])]
        return ids, r

    def good(self):
        with self.client() as client:
            while not self.stop.is_set():
                prompt = self.rng.choice(PROMPTS)
                stream = self.rng.random() < 0.5
                sampling = self.rng.choice(GREEDY_LIMITS)
                tic, changes = time.perf_counter(), self.fault_changes
                try:
                    ids, r = self.solo(client, prompt, stream, sampling)
                except httpx.TimeoutException:
                    self.count("good", "good_hung")
                    continue
                except httpx.TransportError as e:
                    self.count("good", "good_wrong")
                    self.wrong.append(f"{prompt!r}: {type(e).__name__}")
                    continue
                if ids is not None:
                    self.latencies.append(time.perf_counter() - tic)
                    ok = ids == self.reference[prompt]
                    self.count("good", "good_correct" if ok else "good_wrong")
                    if not ok:
                        self.wrong.append(f"{prompt!r} (stream={stream}, {sampling}): "
                                          f"{ids} != {self.reference[prompt]}")
                    continue
                message = r if isinstance(r, str) else r.text
                status = 500 if isinstance(r, str) else r.status_code
                if status >= 500:
                    self.count("5xx")
                met_fault = changes % 2 or self.fault_changes != changes
                if status == 500 and "checksum mismatch" in message and met_fault:
                    self.count("good", "good_failed_by_fault")
                elif MARKER in message:
                    self.count("good", "good_wrong", "good_failed_by_another")
                    self.wrong.append(f"{prompt!r}: failed by another: {message[:200]}")
                else:
                    self.count("good", "good_wrong")
                    self.wrong.append(f"{prompt!r}: {status} {message[:200]}")

    # -- bad requests, stalled and vanishing clients -------------------------------------
    def bad(self):
        cases = bad_requests(self.url)
        with self.client() as client:
            while not self.stop.is_set():
                name, send = self.rng.choice(cases)
                changes = self.fault_changes
                try:
                    status = send(client)
                except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) \
                        if name in SLOW_TO_SEND else () as e:
                    status = 408  # closed past --request-timeout while its body was sent
                    self.count("bad_closed_by_deadline")
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.count("bad")
                with self.lock:
                    self.refused[name, status] += 1
                if isinstance(status, int) and 400 <= status < 500:
                    self.count("bad_refused_4xx")
                elif status == FAULT and (changes % 2 or self.fault_changes != changes):
                    self.count("bad_failed_by_fault", "5xx")
                else:
                    self.count("bad_not_refused", *(["5xx"] if status in range(500, 600)
                                                    else []))
                    self.wrong.append(f"bad request {name!r}: {status}")
                time.sleep(0.05)

    def stalled(self):
        port = int(self.url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": self.rng.choice(PROMPTS), "max_tokens": 1500,
                           "stream": True, "logprobs": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        while not self.stop.is_set():
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(request)
            self.count("stalled")
            self.stop.wait(45)  # never reads; the server must give up on it
            s.close()

    def vanishing(self):
        with httpx.Client(timeout=self.args.request_timeout) as client:
            while not self.stop.is_set():
                try:
                    with client.stream("POST", f"{self.url}/v1/completions",
                                       json={"prompt": self.rng.choice(PROMPTS),
                                             "max_tokens": 400, "stream": True}) as r:
                        for _, _ in zip(r.iter_lines(), range(self.rng.randint(1, 8))):
                            pass
                except httpx.HTTPError:
                    pass
                self.count("vanishing")
                self.stop.wait(1)

    def poison(self):
        """Requests that pass every check and decode beside the good ones: strict JSON
        under a grammar with top logprobs, and a penalty at the edge of its range."""
        bodies = [("/v1/chat/completions", {
                      "messages": [{"role": "user", "content": MARKER}], "max_tokens": 12,
                      "logprobs": True, "top_logprobs": 20,
                      "response_format": {"type": "json_object"}}),
                  ("/api/chat", {"model": "pack", "stream": False, "format": "json",
                                 "messages": [{"role": "user", "content": MARKER}],
                                 "options": {"temperature": 1000, "repeat_penalty": 0.001,
                                             "num_predict": 12}})]
        with httpx.Client(timeout=self.args.request_timeout) as client:
            while not self.stop.is_set():
                path, body = self.rng.choice(bodies)
                try:
                    r = client.post(f"{self.url}{path}", json=body)
                    json.loads(r.text.replace("data: [DONE]", "") if not body.get("stream")
                               else "[]", parse_constant=_no_constant)
                    for line in r.text.splitlines():
                        if line.startswith("data: {"):
                            json.loads(line[6:], parse_constant=_no_constant)
                    fault = r.status_code == 500 and "checksum mismatch" in r.text
                    self.count("poison", f"poison_{r.status_code}{'_fault' if fault else ''}")
                except ValueError as e:  # NaN or Infinity in a response
                    self.count("poison", "poison_not_json")
                    self.wrong.append(f"poison: {e}")
                except httpx.HTTPError:
                    self.count("poison", "poison_transport_error")
                self.stop.wait(0.2)

    def bombs(self):
        with httpx.Client(timeout=self.args.request_timeout) as client:
            while not self.stop.is_set():
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "chat_template_kwargs": {"chat_template": self.rng.choice(BOMBS)}}
                try:
                    status = client.post(f"{self.url}/v1/chat/completions",
                                         json=body).status_code
                except httpx.TimeoutException:
                    status = "hung"
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.count("bombs", "bombs_refused_4xx" if status in range(400, 500)
                           else "bombs_not_refused")
                if status not in range(400, 500):
                    self.wrong.append(f"template bomb: {status}")

    def slow(self):
        """Connections that trickle a body, from an address of their own (an attacker's
        is not its victims'); the server's deadline must close them. From the good and
        bad clients' own address, they made the server's per-client limit (64) close
        those clients' connections still reading a request (ReadErrors), as it must."""
        port = int(self.url.rsplit(":", 1)[1])
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                b"application/json\r\nContent-Length: 1000\r\n\r\n{")
        while not self.stop.is_set():
            held = []
            for _ in range(256):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5,
                                                 source_address=(FLOOD_ADDRESS, 0))
                    s.sendall(head)
                    held.append(s)
                except OSError:
                    pass
            self.count(*["slow"] * len(held))
            for _ in range(15):  # 30 s of a byte every 2 s each
                if self.stop.wait(2):
                    break
                for s in list(held):
                    try:
                        s.send(b" ")
                    except OSError:
                        held.remove(s)
                        s.close()
                        self.count("slow_closed_by_server")
            for s in held:
                s.close()

    def health(self):
        with httpx.Client(timeout=self.args.request_timeout) as client:
            while not self.stop.is_set():
                tic = time.perf_counter()
                try:
                    if client.get(f"{self.url}/health").status_code != 200:
                        self.count("health_not_200")
                    self.health_s.append(time.perf_counter() - tic)
                except httpx.TimeoutException:
                    self.count("health_hung")
                except httpx.HTTPError:
                    self.count("health_failed")
                self.stop.wait(0.5)

    # -- file faults ---------------------------------------------------------------
    def faults(self):
        pack = Pack.open(self.pack)
        records = [(l.index, e, r) for l in pack.layers for e, r in enumerate(l.records)]
        with open(pack.experts_path, "r+b") as f:
            while not self.stop.wait(self.args.fault_every):
                layer, expert, record = self.rng.choice(records)
                at = record.offset + self.rng.randrange(record.length)
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
                f.flush()
                self.fault_changes += 1
                self.count("faults")
                self.stop.wait(self.args.fault_for)
                f.seek(at)
                f.write(byte)
                f.flush()
                self.fault_changes += 1

    def run(self):
        workers = ([self.good] * self.args.good_clients + [self.bad, self.stalled,
                   self.vanishing, self.health, self.faults, self.poison, self.slow]
                   + [self.bombs] * 2)
        threads = [threading.Thread(target=w, daemon=True) for w in workers]
        for t in threads:
            t.start()
        time.sleep(self.args.duration)
        self.stop.set()
        for t in threads:
            t.join(self.args.request_timeout + 10)
        return [t for t in threads if t.is_alive()]


def _no_constant(name):
    raise ValueError(f"{name} in a response (not JSON)")


def warm_up(url: str, timeout: float):
    """One good request of each feature that builds something once (the grammar engine's
    view of the tokenizer, the chat template, each API's first use), so that RSS at the
    start is the server's working size, not its cold one (rss_cold_bytes)."""
    user = [{"role": "user", "content": "hi"}]
    with httpx.Client(timeout=timeout) as c:
        c.post(f"{url}/v1/chat/completions", json={"messages": user, "max_tokens": 8,
                                                   "response_format": {"type": "json_object"}})
        c.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 8})
        c.post(f"{url}/api/chat", json={"model": "pack", "messages": user, "stream": False,
                                        "options": {"num_predict": 8}})
        c.post(f"{url}/v1/messages", json={"model": "pack", "messages": user,
                                           "max_tokens": 8})


def working_rss(pid: int, url: str) -> int:
    """The server's RSS less what its prompt cache keeps on purpose (bounded by
    --prompt-cache-size/-bytes, reported by /metrics): a chaos run fills the cache with
    its prompts' KV, which later requests reuse; that is not memory a request leaked."""
    kept = httpx.get(f"{url}/metrics", timeout=30).json()["prompt_cache"]["bytes"]
    return rss_bytes(pid) - kept


def memory(pid: int, url: str) -> dict:
    """Where the server's memory is, in MB: RSS, of it anonymous (heaps, MLX's buffers)
    and file-backed (code, mapped files); the prompt cache's bytes, MLX's live arrays and
    its buffer cache (/metrics); and the working RSS the check reads (RSS less the
    prompt cache)."""
    rollup = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        rollup[key] = int(value.split()[0]) * 1024
    m = httpx.get(f"{url}/metrics", timeout=30).json()
    mb = lambda n: round(n / 2**20, 1)  # noqa: E731
    return {"rss_mb": mb(rollup["Rss"]), "anonymous_mb": mb(rollup["Anonymous"]),
            "file_mb": mb(rollup["Rss"] - rollup["Anonymous"]),
            "prompt_cache_mb": mb(m["prompt_cache"]["bytes"]),
            "mlx_active_mb": mb(m["memory"]["mlx_active_bytes"]),
            "mlx_cache_mb": mb(m["memory"]["mlx_cache_bytes"]),
            "working_rss_mb": mb(rollup["Rss"] - m["prompt_cache"]["bytes"]),
            "threads": len(list(Path(f"/proc/{pid}/task").iterdir()))}


def settled_rss(pid: int, url: str, start: int) -> float:
    """Seconds until the server's working RSS is back within 10% of `start` (a grammar
    bomb's abandoned mask gives its memory back when it ends), at most RSS_SETTLE_S."""
    tic = time.perf_counter()
    while (working_rss(pid, url) > 1.1 * start
           and time.perf_counter() - tic < RSS_SETTLE_S):
        time.sleep(1)
    return round(time.perf_counter() - tic, 1)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


MEMORY_PROBES = ["grammar bomb", "template bomb", "responses 3.9 MB input", "5 MB body",
                 "deep JSON"]


def probe_memory(url: str, pid: int, n: int, wait_s: float = 12) -> dict:
    """`n` of each memory-hungry bad request, 4 at a time, kind after kind, on a warm
    server: where its memory is once each kind is answered and the server has been idle
    `wait_s` seconds (its idle trim runs every 5 s)."""
    cases = dict(bad_requests(url))
    templates = itertools.cycle(BOMBS)
    cases["template bomb"] = lambda c: c.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"chat_template": next(templates)}}).status_code
    report = {"start": memory(pid, url)}

    def send(kind):
        with httpx.Client(timeout=120) as c:
            try:
                return cases[kind](c)
            except httpx.HTTPError as e:
                return type(e).__name__

    for kind in MEMORY_PROBES:
        with ThreadPoolExecutor(4) as pool:
            statuses = Counter(pool.map(lambda _: send(kind), range(n)))
        time.sleep(wait_s)
        report[kind] = {"statuses": {str(k): v for k, v in statuses.items()},
                        **memory(pid, url)}
        print(f"chaos: {kind}: {report[kind]}", file=sys.stderr)
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(BUNDLED_MODEL), help="An edgemoe pack (copied)")
    p.add_argument("--duration", type=float, default=180)
    p.add_argument("--good-clients", type=int, default=3)
    p.add_argument("--fault-every", type=float, default=20)
    p.add_argument("--fault-for", type=float, default=3)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--probe-memory", type=int, default=0, metavar="N",
                   help="Instead of the chaos: send N of each memory-hungry bad request "
                        "(MEMORY_PROBES) and report where the memory is after each kind")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="edgemoe-chaos-") as tmp:
        pack = Path(shutil.copytree(args.model, Path(tmp) / "pack"))
        proc, url = start_server(str(pack), *SERVER_FLAGS, tool="chaos")
        try:
            if args.probe_memory:
                warm_up(url, args.request_timeout)
                time.sleep(7)  # one idle trim
                report = probe_memory(url, proc.pid, args.probe_memory)
                report["checks"] = {"working RSS back within 10% of its start": all(
                    v["working_rss_mb"] <= 1.1 * report["start"]["working_rss_mb"]
                    for v in report.values())}
                return finish(report, args)
            chaos = Chaos(url, pack, args)
            with httpx.Client(timeout=args.request_timeout) as client:
                for prompt in PROMPTS:  # each prompt alone, before any chaos
                    chaos.reference[prompt], _ = chaos.solo(client, prompt, stream=False)
            cold_rss = rss_bytes(proc.pid)
            warm_up(url, args.request_timeout)
            rss_before = rss_bytes(proc.pid)
            working_before = working_rss(proc.pid, url)
            memory_before = memory(proc.pid, url)
            print(f"chaos: {args.duration:.0f} s against {url} ({args.good_clients} good "
                  f"clients; a fault every {args.fault_every:.0f} s)", file=sys.stderr)
            alive = chaos.run()
            time.sleep(3)  # let cancelled rows drain
            memory_at_end = memory(proc.pid, url)
            settle_s = settled_rss(proc.pid, url, working_before)
            metrics = httpx.get(f"{url}/metrics", timeout=30).json()
            proc.log.seek(0)
            send_timeouts = proc.log.read().count("the client read nothing")
            report = {
                "duration_s": args.duration, "sent": {k: chaos.counts[k] for k in (
                    "good", "bad", "stalled", "vanishing", "poison", "bombs", "slow")},
                **{k: chaos.counts[k] for k in ("good_correct", "good_failed_by_fault",
                                               "good_wrong", "good_hung",
                                               "good_failed_by_another", "bad_refused_4xx",
                                               "bad_not_refused", "bad_failed_by_fault",
                                               "bad_closed_by_deadline",
                                               "5xx", "faults",
                                               "health_hung", "health_failed",
                                               "health_not_200", "bombs_refused_4xx",
                                               "bombs_not_refused",
                                               "slow_closed_by_server")},
                "poison_by_outcome": {k[7:]: n for k, n in sorted(chaos.counts.items())
                                      if k.startswith("poison_")},
                "good_p95_latency_s": float(np.percentile(chaos.latencies, 95))
                if chaos.latencies else None,
                "health_max_s": max(chaos.health_s) if chaos.health_s else None,
                "rss_cold_bytes": cold_rss,
                "rss_before_bytes": rss_before, "rss_after_bytes": rss_bytes(proc.pid),
                "rss_settle_s": settle_s,
                "working_rss_before_bytes": working_before,
                "working_rss_after_bytes": working_rss(proc.pid, url),
                "prompt_cache_bytes_after": metrics["prompt_cache"]["bytes"],
                "memory": {"before": memory_before, "at_end": memory_at_end,
                           "after_settling": memory(proc.pid, url)},
                "rows_active_after": metrics["requests"]["active"],
                "stalled_cancelled_by_send_timeout": send_timeouts,
                "server_requests": metrics["requests"],
                "bad_by_kind": {f"{name}: {status}": n
                                for (name, status), n in sorted(chaos.refused.items(), key=str)},
                "workers_stuck": len(alive), "wrong_examples": chaos.wrong[:10],
            }
            report["checks"] = checks(report)
        finally:
            proc.terminate()
            proc.wait(30)
    return finish(report, args)


def finish(report: dict, args) -> int:
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if all(report["checks"].values()) else 1


def checks(report: dict) -> dict:
    """What a chaos run must show (the issue's bar), each true or false."""
    return {"0 wrong outputs": report["good_wrong"] == 0,
            "0 hangs": report["good_hung"] == 0 and report["health_hung"] == 0,
            "every bad request refused": report["bad_not_refused"] == 0
            and report["bombs_not_refused"] == 0,
            "RSS back within 10% of its start (less the prompt cache's bytes)":
            report["working_rss_after_bytes"] <= 1.1 * report["working_rss_before_bytes"],
            "no worker stuck": report["workers_stuck"] == 0,
            "no row left active": report["rows_active_after"] == 0}


if __name__ == "__main__":
    sys.exit(main())
