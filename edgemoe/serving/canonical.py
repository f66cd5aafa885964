"""The one request every API's parser produces, and the one result every API renders.

As llama.cpp's server does it: each dialect (edgemoe.serving.openai, .responses,
.anthropic, .ollama) reads its body at the edge into these types (a `Conversation` for a
chat, a `Generation` for what the engine runs) and renders a `Result` (or the engine's
events, streamed) in its own shape; what runs a request knows no dialect."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .chat import Reply, no_tool_format, render
from .constrain import forced_call
from .errors import BadRequest
from .job import Job
from ..sampling_params import check_sampling, sampler_args


@dataclass
class Sampling:
    """How the next token is chosen (greedy by default)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    penalties: Optional[dict] = None  # mlx-lm's make_logits_processors keywords
    logit_bias: Optional[Dict[int, float]] = None


@dataclass
class ToolChoice:
    """Whether the reply calls a tool: "none" (its tools are not shown), "auto" (the model
    decides; its calls are read by the model's tool parser) or "required" (one call,
    forced by a grammar: of `name`, or of any tool)."""

    mode: str = "auto"
    name: Optional[str] = None


@dataclass
class Conversation:
    """A chat as the chat template takes it: messages and tools in OpenAI's form."""

    messages: List[dict]
    tools: Optional[list] = None
    choice: ToolChoice = field(default_factory=ToolChoice)
    grammar: object = None  # the text's own grammar (a response format), or None
    template_args: dict = field(default_factory=dict)
    role_mapping: Optional[dict] = None
    max_calls: Optional[int] = None  # the most calls read from the reply (None: all)

    def prompt(self, server):
        """(the prompt's tokens, the grammar its reply follows, the `Reply` reading it).
        A forced call is the reply: a response format has nothing left to shape."""
        tools, choice, grammar = self.tools, self.choice, self.grammar
        if choice.mode == "auto" and tools and server.tokenizer.tool_parser is None:
            raise BadRequest(no_tool_format(server.tokenizer), "tools")
        if choice.mode == "required":
            grammar = forced_call(server, tools, choice.name)
        shown = tools if choice.mode != "none" else None
        prompt = render(server.tokenizer, self.messages, shown, self.template_args,
                        self.role_mapping)
        return prompt, grammar, Reply(server.tokenizer, prompt, tools,
                                      parse_tools=choice.mode == "auto",
                                      forced=choice.mode == "required",
                                      max_calls=self.max_calls)


@dataclass
class Generation:
    """What the engine runs: a prompt's tokens, how far and how to continue it. The
    names are the dialect's, for its error messages."""

    prompt: List[int]
    max_tokens: Optional[int]  # None: the server's default, within the context
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens_name: str = "max_tokens"
    prompt_param: str = "prompt"
    sampling_prefix: str = ""  # where the dialect's sampling fields are ("options.")
    sampling_names: Dict[str, str] = field(default_factory=dict)  # its other names
    grammar: object = None
    id_prefix: str = "req-"
    want_logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    use_prompt_cache: bool = True
    num_draft_tokens: Optional[int] = None

    def job(self, id: str, context_length: int, default_max_tokens: int) -> Job:
        """The engine's job: the prompt's length checked against the context, its
        sampling, penalties and grammar."""
        prompt, param = self.prompt, self.prompt_param
        if not prompt:
            raise BadRequest("the prompt is empty after tokenization", param)
        room = context_length - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt is {len(prompt)} tokens; the model's context is "
                             f"{context_length} tokens, and at least one must be left "
                             f"for the completion", param)
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        elif max_tokens > room:
            raise BadRequest(f"the model's context is {context_length} tokens; the "
                             f"prompt is {len(prompt)} and '{self.max_tokens_name}' asks "
                             f"for {max_tokens} more ({len(prompt) + max_tokens} in all)",
                             self.max_tokens_name)
        s = self.sampling
        bad = check_sampling(s.temperature, s.penalties)
        if bad is not None:  # a row whose logits would become NaN (sampling_params)
            name = self.sampling_prefix + self.sampling_names.get(bad[0], bad[0])
            raise BadRequest(f"'{name}' {bad[1]}", name)
        processors = []
        if s.logit_bias or any((s.penalties or {}).values()):
            from mlx_lm.sample_utils import make_logits_processors
            processors = make_logits_processors(s.logit_bias or None, **(s.penalties or {}))
        return Job(id=self.id_prefix + id, prompt=prompt, max_tokens=max_tokens,
                   emit=lambda e: None,
                   sampling=sampler_args(s.temperature, s.top_p, s.min_p, s.top_k, s.seed),
                   stop=s.stop, processors=processors, grammar=self.grammar,
                   want_logprobs=self.want_logprobs, top_logprobs=self.top_logprobs,
                   prompt_logprobs=self.prompt_logprobs,
                   use_prompt_cache=self.use_prompt_cache,
                   num_draft_tokens=self.num_draft_tokens)


@dataclass
class Delivery:
    """How a request's result goes back: under which model name, streamed or whole. A
    dialect's own subclass adds what its rendering needs."""

    model: str
    stream: bool


@dataclass
class Result:
    """A request's whole result: its token events and its last event (done or error)."""

    events: List[dict]
    last: dict

    @property
    def text(self) -> str:
        return "".join(e["text"] for e in self.events)
