"""What coding agents add to Anthropic's Messages requests, taken as the API takes it.

Claude Code (2.1.x) sends, on every turn: `thinking` ({"type": "adaptive"}, "enabled" with
a budget, or "disabled"), `output_config` ({"effort": ...}), `context_management`
({"edits": [...]}), and, under its beta header, `role: "system"` messages in the middle of
the conversation. Here:

- `thinking` switches the chat template's thinking (enable_thinking) on a model that
  thinks; on one that does not it changes nothing and is accepted. Its budget is not
  enforced (the reply's max_tokens bounds it).
- `output_config.effort` is a hint with no effect here; any other `output_config` entry
  (a format) would change the reply, and is refused.
- `context_management` edits clear old thinking or tool results once a prompt passes a
  threshold (100K tokens by default), past any context served here: accepted, no effect.
- system messages anywhere are folded, in order, into the system prompt (chat templates
  take one system message, first), so a conversation's prefix stays the same from turn to
  turn and its prompt cache holds.
"""

from typing import List, Optional, Tuple

from .chat import text_of
from .errors import BadRequest
from .fields import field, refuse_unknown

AGENT_FIELDS = {"thinking", "output_config", "context_management"}
THINKING = ("enabled", "disabled", "adaptive")
EFFORTS = ("low", "medium", "high", "max", "xhigh")
# Anthropic's stop_reason when generation stopped at the context, not at max_tokens
WINDOW_EXCEEDED = "model_context_window_exceeded"


def check_agent_fields(body: dict):
    """A 400 naming the first of these fields whose form is wrong."""
    thinking = field(body, "thinking", dict, None)
    if thinking is not None:
        if thinking.get("type") not in THINKING:
            raise BadRequest(f"'thinking.type' must be one of {', '.join(THINKING)}, got "
                             f"{thinking.get('type')!r}", "thinking.type")
        field(thinking, "budget_tokens", int, None, lo=0, where="thinking.")
    config = field(body, "output_config", dict, None)
    if config is not None:
        refuse_unknown(config, {"effort"}, "output_config", "output_config.")
        effort = config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise BadRequest(f"'output_config.effort' must be one of {', '.join(EFFORTS)}, "
                             f"got {effort!r}", "output_config.effort")
    management = field(body, "context_management", dict, None)
    if management is not None:
        field(management, "edits", list, None, where="context_management.")


def thinking_args(server, body: dict) -> dict:
    """The chat template's arguments for this request: the server's, with thinking
    switched as `thinking` asks on a model that thinks."""
    args = dict(server.template_args)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and server.tokenizer.has_thinking:
        args["enable_thinking"] = thinking.get("type") != "disabled"
    return args


def fold_system(system, messages: list) -> Tuple[Optional[str], List[Tuple[int, dict]]]:
    """(the system prompt: `system` and every system message's text, in order, joined by
    blank lines, or None; the other messages with their indices)."""
    parts = [] if system is None else [text_of(system, "system")]
    rest = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "system":
            refuse_unknown(m, {"role", "content"}, "messages", f"messages.{i}.")
            parts.append(text_of(m.get("content"), f"messages.{i}"))
        else:
            rest.append((i, m))
    return ("\n\n".join(parts) if parts else None), rest
