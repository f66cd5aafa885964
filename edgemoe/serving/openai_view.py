"""OpenAI's responses (chat completions and completions): a request's result whole, or
its events as server-sent chunks (edgemoe.serving.openai reads the requests)."""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .. import __version__
from .canonical import Delivery, Result
from .chat import Reply, token_pieces
from .errors import error_response
from .http import Server, public, sse


@dataclass
class OpenAIDelivery(Delivery):
    include_usage: bool = False  # stream_options: a last chunk with the usage
    echo: bool = False  # completions: the prompt's text before the completion's
    score_only: bool = False  # completions with max_tokens 0: the prompt scored alone


def error(message: str, status: int, param: Optional[str]):
    return error_response(message, status, param,
                          "invalid_request_error" if status < 500 else "server_error")


def summed(usages: List[dict]) -> dict:
    """The usage of several choices (a completions request of several prompts)."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {**{k: sum(u[k] for u in usages) for k in keys},
            "prompt_tokens_details": {"cached_tokens": sum(
                u["prompt_tokens_details"]["cached_tokens"] for u in usages)}}


class View:
    """One request's events as OpenAI's responses: whole, or as server-sent chunks.
    `index`: its choice's (one of several prompts); `alone`: the stream is its own (it
    ends with the usage chunk and [DONE]), not one of several merged."""

    def __init__(self, server: Server, job, delivery: OpenAIDelivery,
                 reply: Optional[Reply], index: int = 0, alone: bool = True):
        self.server, self.job, self.delivery, self.reply = server, job, delivery, reply
        self.chat = reply is not None
        self.index, self.alone = index, alone
        self.started = False
        self.offset = 0  # the text's length so far (streamed completions' text_offset)
        self.usage: Optional[dict] = None  # once done

    def base(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.job.id, "object": kind, "created": self.server.created,
                "model": self.delivery.model, "system_fingerprint": f"edgemoe-{__version__}"}

    def _usage(self, last: dict) -> dict:
        p = last["prompt_tokens"]
        c = 0 if self.delivery.score_only else last["completion_tokens"]
        self.usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                      "prompt_tokens_details": {"cached_tokens": last["cached_tokens"]}}
        return self.usage

    def _entries(self, events: List[dict]) -> List[dict]:
        """Chat logprobs entries (also mlx_lm.server's completions form, with ids)."""
        tok = self.server.tokenizer
        ids = [e["token"] for e in events]
        tops = [e["top"] or [] for e in events]
        pieces = token_pieces(tok, ids + [t for top in tops for t, _ in top])
        chosen, rest = pieces[:len(ids)], iter(pieces[len(ids):])
        out = []
        for e, (text, data), top in zip(events, chosen, tops):
            entry = {"id": e["token"], "token": text, "logprob": e["logprob"],
                     "bytes": data, "top_logprobs": []}
            for t, lp in top:
                t_text, t_data = next(rest)
                entry["top_logprobs"].append({"id": t, "token": t_text, "logprob": lp,
                                              "bytes": t_data})
            out.append(entry)
        return out

    def _legacy(self, entries: List[dict], offset: int, prompt: Optional[List] = None):
        """Completions logprobs in OpenAI's form (tokens, token_logprobs, top_logprobs,
        text_offset), beside mlx_lm.server's `content`."""
        entries = (prompt or []) + entries
        offsets, at = [], offset
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                 if e["top_logprobs"] else None for e in entries]
                if self.job.top_logprobs else None,
                "text_offset": offsets, "content": entries}

    def _prompt_entries(self, last: dict) -> List[dict]:
        """The prompt's tokens as logprobs entries: each one's logprob given the tokens
        before it (the first has none) and, asked for, the most likely tokens there."""
        scores = last.get("prompt_logprobs") or []
        tops = last.get("prompt_top") if self.job.top_logprobs else None
        tops = tops or [None] * len(scores)
        events = [{"token": t, "logprob": lp, "top": top}
                  for t, lp, top in zip(self.job.prompt, scores, tops)]
        return self._entries(events)

    def _echo(self) -> str:
        """The prompt's text, exactly its tokens' bytes (no space trimmed)."""
        if not self.delivery.echo:
            return ""
        pieces = token_pieces(self.server.tokenizer, self.job.prompt)
        return b"".join(bytes(data) for _, data in pieces).decode("utf-8", "replace")

    def _shown(self, events: List[dict]) -> List[dict]:
        return [] if self.delivery.score_only else events

    def whole(self, result: Result) -> dict:
        out = self.base(chunk=False)
        events, last = self._shown(result.events), result.last
        text = "".join(e["text"] for e in events)
        choice: Dict[str, Any] = {"index": self.index,
                                  "finish_reason": last["finish_reason"], "logprobs": None}
        if self.chat:
            content, reasoning, calls = self.reply.feed(text, final=True)
            # "" for an empty reply, as OpenAI's; null beside tool calls, as OpenAI's
            message: Dict[str, Any] = {"role": "assistant",
                                       "content": content if content or not calls else None}
            if reasoning:
                message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choice["message"] = message
            choice["finish_reason"] = self.reply.finish_reason(last["finish_reason"])
            if self.job.want_logprobs:
                choice["logprobs"] = {"content": self._entries(events)}
        else:
            echo = self._echo()
            choice["text"] = echo + text
            if self.delivery.score_only:
                choice["finish_reason"] = "length"
            if self.job.want_logprobs:
                prompt = self._prompt_entries(last) if self.delivery.echo else None
                choice["logprobs"] = self._legacy(self._entries(events),
                                                  0 if prompt else len(echo), prompt)
        out["choices"] = [choice]
        out["usage"] = self._usage(last)
        return out

    def chunks(self, event: dict):
        """The SSE chunks of one engine event."""
        if event["type"] == "error":
            yield sse({"error": {"message": public(event["message"]),
                                 "type": "server_error", "param": None, "code": None}})
            return
        if not self.started and not self.chat and self.delivery.echo:
            self.started = True
            echo, logprobs = self._echo(), None
            if self.job.want_logprobs:  # the prompt was scored before its first token came
                logprobs = self._legacy([], 0, self._prompt_entries(
                    {"prompt_logprobs": self.job.prompt_scores,
                     "prompt_top": self.job.prompt_top}))
            self.offset = len(echo)
            yield sse(self._chunk({"text": echo}, None, logprobs))
        self.started = True
        if event["type"] == "token":
            if not self.delivery.score_only:
                yield from self._token_chunks(event)
            return
        finish = "length" if self.delivery.score_only else event["finish_reason"]
        if self.chat:
            content, reasoning, calls = self.reply.feed("", final=True)
            if content or reasoning or calls:
                yield sse(self._chunk(self._delta(content, reasoning, calls)))
            finish = self.reply.finish_reason(finish)
        yield sse(self._chunk({} if self.chat else {"text": ""}, finish))
        usage = self._usage(event)
        if not self.alone:
            return
        if self.delivery.include_usage:
            tail = self.base(chunk=True)
            tail.update(choices=[], usage=usage)
            yield sse(tail)
        yield "data: [DONE]\n\n"

    def _token_chunks(self, event: dict):
        logprobs = None
        if self.job.want_logprobs:
            entries = self._entries([event])
            logprobs = {"content": entries} if self.chat else \
                self._legacy(entries, self.offset)
            self.offset += len(entries[0]["token"])
        if self.chat:
            content, reasoning, calls = self.reply.feed(event["text"])
            if content or reasoning or calls or logprobs:
                yield sse(self._chunk(self._delta(content, reasoning, calls), None,
                                      logprobs))
        elif event["text"] or logprobs:
            yield sse(self._chunk({"text": event["text"]}, None, logprobs))

    def _delta(self, content: str, reasoning: str, calls: List[dict]) -> dict:
        delta: Dict[str, Any] = {"role": "assistant"}
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning"] = reasoning
        if calls:
            first = len(self.reply.calls) - len(calls)
            delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(calls)]
        return delta

    def _chunk(self, part: dict, finish: Optional[str] = None, logprobs=None) -> dict:
        out = self.base(chunk=True)
        choice: Dict[str, Any] = {"index": self.index, "finish_reason": finish,
                                  "logprobs": logprobs}
        if self.chat:
            choice["delta"] = part
        else:
            choice.update(part)
        out["choices"] = [choice]
        return out
