"""OpenAI's Responses API's results: a Response whole, or the stream of events OpenAI's
SDK reads (edgemoe.serving.responses reads the requests)."""

import time
import uuid
from dataclasses import dataclass
from typing import List, Optional

from .canonical import Delivery, Result
from .chat import Reply
from .http import public, sse


@dataclass
class ResponsesDelivery(Delivery):
    settings: dict  # the request's settings, which every Response repeats


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseView:
    """One request's events as a Response, or as the SDK's stream of response events."""

    def __init__(self, job, delivery: ResponsesDelivery, reply: Reply):
        self.job, self.delivery, self.reply = job, delivery, reply
        self.created = int(time.time())
        self.sequence = 0
        self.output: List[dict] = []  # the items so far
        self.message: Optional[dict] = None  # the open message item (streamed)
        self.reasoning: List[str] = []

    # -- the response ------------------------------------------------------------------
    def _response(self, status: str, last: Optional[dict] = None) -> dict:
        out = {"id": self.job.id, "object": "response", "created_at": self.created,
               "status": status, "model": self.delivery.model, "output": list(self.output),
               "error": None, "incomplete_details": None, "usage": None,
               **self.delivery.settings}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if last is not None:
            p, c = last["prompt_tokens"], last["completion_tokens"]
            out["usage"] = {"input_tokens": p,
                            # (cache_write_tokens: the SDK's type requires it)
                            "input_tokens_details": {"cached_tokens": last["cached_tokens"],
                                                     "cache_write_tokens": 0},
                            "output_tokens": c,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": p + c}
        return out

    def _status(self, last: dict) -> str:
        return "incomplete" if last["finish_reason"] == "length" else "completed"

    @staticmethod
    def _text_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}]}

    @staticmethod
    def _call_item(call: dict) -> dict:
        return {"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                "status": "completed"}

    def _reasoning_item(self, text: str) -> dict:
        return {"type": "reasoning", "id": _id("rs"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def whole(self, result: Result) -> dict:
        last = result.last
        content, reasoning, calls = self.reply.feed(result.text, final=True)
        if reasoning:
            self.output.append(self._reasoning_item(reasoning))
        if content or not calls:
            self.output.append(self._text_item(content))
        self.output += [self._call_item(c) for c in calls]
        return self._response(self._status(last), last)

    # -- streaming -----------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(event, kind)

    def chunks(self, event: dict):
        if event["type"] == "error":
            yield self._event("error", code="server_error",
                              message=public(event["message"]), param=None)
            return
        if self.sequence == 0:
            yield self._event("response.created", response=self._response("in_progress"))
            yield self._event("response.in_progress",
                              response=self._response("in_progress"))
        if event["type"] == "token":
            yield from self._pieces(*self.reply.feed(event["text"]))
            return
        yield from self._pieces(*self.reply.feed("", final=True))
        if not self.output and self.message is None:  # an empty reply: an empty message
            yield from self._open_message()
        yield from self._close_message()
        if self.reasoning:
            item = self._reasoning_item("".join(self.reasoning))
            index = len(self.output)
            self.output.append(item)
            yield self._event("response.output_item.added", output_index=index, item=item)
            yield self._event("response.output_item.done", output_index=index, item=item)
        status = self._status(event)
        yield self._event(f"response.{status}", response=self._response(status, event))

    def _pieces(self, content: str, reasoning: str, calls: List[dict]):
        if reasoning:
            self.reasoning.append(reasoning)
        if content:
            if self.message is None:
                yield from self._open_message()
            self.message["content"][0]["text"] += content
            yield self._event("response.output_text.delta", item_id=self.message["id"],
                              output_index=len(self.output), content_index=0,
                              delta=content, logprobs=[])
        for call in calls:
            yield from self._close_message()
            item = self._call_item(call)
            index = len(self.output)
            yield self._event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, name=item["name"],
                              arguments=item["arguments"])
            self.output.append(item)
            yield self._event("response.output_item.done", output_index=index, item=item)

    def _open_message(self):
        self.message = self._text_item("", "in_progress")
        self.message["content"] = []
        index = len(self.output)
        yield self._event("response.output_item.added", output_index=index,
                          item=self.message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.message = {**self.message, "content": [part]}
        yield self._event("response.content_part.added", item_id=self.message["id"],
                          output_index=index, content_index=0, part=part)

    def _close_message(self):
        if self.message is None:
            return
        index = len(self.output)
        item, self.message = {**self.message, "status": "completed"}, None
        part = item["content"][0]
        yield self._event("response.output_text.done", item_id=item["id"],
                          output_index=index, content_index=0, text=part["text"],
                          logprobs=[])
        yield self._event("response.content_part.done", item_id=item["id"],
                          output_index=index, content_index=0, part=part)
        self.output.append(item)
        yield self._event("response.output_item.done", output_index=index, item=item)
