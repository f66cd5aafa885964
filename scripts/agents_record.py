"""A stand-in model server that records what a coding agent sends: every request's method,
path, headers (credentials masked) and JSON body, one JSON object a line, and answers each
with a short canned reply in the API's shape (streamed when asked), so that the agent
finishes its turn. How tests/data/agents/ was made (see its README):

    python scripts/agents_record.py --port 8787 --out requests.jsonl
    ANTHROPIC_BASE_URL=http://127.0.0.1:8787 ANTHROPIC_API_KEY=x claude -p "hi"
"""

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "openai-organization",
                  "chatgpt-account-id"}
REPLY = "Hello."
# the first request of a turn gets a tool call (so the agent's next request carries the
# call and its result); the one after the result, text
CALLS = {"messages": ("Bash", {"command": "ls", "description": "List files"}),
         "responses": ("exec_command", {"cmd": "ls"})}


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def messages_stream(model: str, call: bool) -> bytes:
    usage = {"input_tokens": 10, "output_tokens": 1}
    if call:
        name, args = CALLS["messages"]
        block = {"type": "tool_use", "id": "toolu_rec1", "name": name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(args)}
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": REPLY}
    return b"".join([
        sse("message_start", {"type": "message_start", "message": {
            "id": "msg_rec", "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}),
        sse("content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": block}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": delta}),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": "tool_use" if call else "end_turn", "stop_sequence": None},
            "usage": usage}),
        sse("message_stop", {"type": "message_stop"})])


def message_whole(model: str) -> dict:
    return {"id": "msg_rec", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": REPLY}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1}}


def responses_stream(model: str, call: bool) -> bytes:
    item = {"type": "message", "id": "msg_rec", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": REPLY, "annotations": []}]}
    if call:
        name, args = CALLS["responses"]
        item = {"type": "function_call", "id": "fc_rec", "call_id": "call_rec1",
                "name": name, "arguments": json.dumps(args), "status": "completed"}
    base = {"id": "resp_rec", "object": "response", "created_at": int(time.time()),
            "model": model, "output": [], "status": "in_progress"}
    done = {**base, "status": "completed", "output": [item],
            "usage": {"input_tokens": 10, "output_tokens": 1, "total_tokens": 11,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
    events = [("response.created", {"response": base}),
              ("response.output_item.added", {"output_index": 0, "item": {
                  **item, "status": "in_progress"}}),
              *([] if call else [("response.output_text.delta", {
                  "item_id": "msg_rec", "output_index": 0, "content_index": 0,
                  "delta": REPLY})]),
              ("response.output_item.done", {"output_index": 0, "item": item}),
              ("response.completed", {"response": done})]
    return b"".join(sse(kind, {"type": kind, "sequence_number": i, **fields})
                    for i, (kind, fields) in enumerate(events))


class Recorder(BaseHTTPRequestHandler):
    out = None

    def log_message(self, fmt, *args):
        print(f"{self.command} {self.path}", file=sys.stderr, flush=True)

    def _record(self, body):
        headers = {k.lower(): ("<masked>" if k.lower() in SECRET_HEADERS else v)
                   for k, v in self.headers.items()}
        self.out.write(json.dumps({"method": self.command, "path": self.path,
                                   "headers": headers, "body": body}) + "\n")
        self.out.flush()

    def _send(self, status: int, payload: bytes, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def do_HEAD(self):
        self._record(None)
        self._send(200, b"")

    def do_GET(self):
        self._record(None)
        self._send(200, json.dumps({"object": "list", "data": [], "models": []}).encode())

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        self._record(body)
        body = body if isinstance(body, dict) else {}
        model, path = body.get("model", "m"), self.path.split("?")[0]
        if path.endswith("/count_tokens"):
            self._send(200, json.dumps({"input_tokens": 10}).encode())
        elif path.endswith("/messages"):
            last = (body.get("messages") or [{}])[-1].get("content")
            answered = isinstance(last, list) and any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in last)
            call = bool(body.get("tools")) and not answered
            if body.get("stream"):
                self._send(200, messages_stream(model, call), "text/event-stream")
            else:
                self._send(200, json.dumps(message_whole(model)).encode())
        elif path.endswith("/responses"):
            items = body.get("input") if isinstance(body.get("input"), list) else []
            answered = any(isinstance(i, dict) and i.get("type") == "function_call_output"
                           for i in items)
            call = bool(body.get("tools")) and not answered
            self._send(200, responses_stream(model, call), "text/event-stream")
        else:
            self._send(404, json.dumps({"error": "no such route"}).encode())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8787)
    p.add_argument("--out", required=True, help="the JSONL file of requests")
    args = p.parse_args()
    Recorder.out = open(args.out, "a", encoding="utf-8")
    ThreadingHTTPServer(("127.0.0.1", args.port), Recorder).serve_forever()


if __name__ == "__main__":
    main()
