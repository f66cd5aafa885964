"""An HTTP server speaking OpenAI's, Anthropic's and Ollama's APIs: concurrent requests
share one expert store.

    python -m edgemoe.server --model PACK [--host 127.0.0.1] [--port 8080] [--expert-budget 25%]
           [--routing native|advisory|prerouted] [--prerouter DIR]
           [--draft-model MLX_DIR | --prompt-lookup] [--num-draft-tokens 3]
    mlx.launch --backend ring --hosts IP1,IP2 -- python -m edgemoe.server --distributed --model M
        (several hosts as one: host 0 serves HTTP, each host streams its share of the experts)

The HTTP layer is edgemoe.serving.app (the APIs .openai, .responses, .anthropic and .ollama
over what .http shares); the engine
thread that owns the model and decodes every request in flight together is
edgemoe.serving.engine.
"""

import argparse
import logging
import socket
from pathlib import Path
from typing import Tuple

from .cli import tool, tool_parser
from .generate import add_draft_arguments, draft_error, json_object, load_draft
from .machines import machine_defaults
from .options import StreamOptions, number
from .routing.modes import describe_routing, routing_report
from .serving.cache_scope import SCOPES
from .serving.engine import Engine
from .serving.guard import guarded_protocol, stop_within
from .serving.templates import POLICY, RENDER_TIMEOUT_S
from .serving.app import make_app
from .serving.limits import freeze_loaded_objects, pin_mmap_threshold
from .serving.http import DEFAULT_MAX_TOKENS, LOCAL_HOSTS, SEND_TIMEOUT_S, Server

log = logging.getLogger("edgemoe.server")
SEND_BUFFER_BYTES = 256 * 1024
STOP_TIMEOUT_S = 20.0  # after SIGTERM the process ends within this, whatever its threads do


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="A server speaking OpenAI's, Anthropic's and "
                                            "Ollama's APIs, streaming MoE experts from disk.")
    p.add_argument("--model", default=None,
                   help="An edgemoe pack or mlx-lm quantized checkpoint: a folder, or a hub "
                        "id (org/name[@revision]), downloaded into the hub cache (default: "
                        "the bundled model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--allowed-host", action="append", default=None,
                   help="A Host header name requests may carry, beside the bound host and "
                        "localhost names (repeat it; '*' allows any). Bound to 0.0.0.0 or "
                        "::, any is allowed")
    p.add_argument("--max-connections", type=int, default=256,
                   help="Connections open at once; past it a new one closes the oldest "
                        "still reading its request, else gets 503 (default: %(default)s)")
    p.add_argument("--max-client-connections", type=number(int, 1), default=64,
                   help="Connections one client address holds at once, the same way "
                        "(default: %(default)s)")
    p.add_argument("--allow-client-templates", action="store_true",
                   help="Render a request's own chat template "
                        "(chat_template_kwargs.chat_template); refused by default")
    p.add_argument("--template-timeout", type=number(float, 0, above=True),
                   default=RENDER_TIMEOUT_S, metavar="SECONDS",
                   help="A chat template render that takes longer is stopped, its request "
                        "refused (default: %(default)s)")
    p.add_argument("--send-timeout", type=number(float, 0, above=True),
                   default=SEND_TIMEOUT_S, metavar="SECONDS",
                   help="A streamed request whose client reads nothing for this long is "
                        "cancelled, freeing its batch row (default: %(default)s)")
    p.add_argument("--request-timeout", type=number(float, 0, above=True), default=10.0,
                   metavar="SECONDS", help="A connection that takes longer to send a "
                                           "request's headers, or then its body, is "
                                           "closed (default: %(default)s)")
    p.add_argument("--send-buffer", type=number(int, 4096), default=SEND_BUFFER_BYTES,
                   metavar="BYTES", help="Kernel send buffer of each connection "
                                         "(default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="Most requests decoded together; more wait their turn (FIFO)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="Requests queued beyond which new ones get 503")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="Completion length when a request gives none")
    p.add_argument("--prefill-step-size", type=number(int, 1),
                   default=machine_defaults().prefill_step_size,
                   help="Prompt tokens per prefill step: each reads the experts it needs "
                        "once (default: %(default)s, this machine's: docs/mac.md)")
    p.add_argument("--temp", type=number(float, 0), default=None,
                   help="Sampling temperature of requests that give none (default: 0, "
                        "greedy; Ollama's API: 0.8, Ollama's default)")
    p.add_argument("--top-p", type=number(float, 0, 1), default=None,
                   help="top_p of requests that give none (default: 1; Ollama's API: 0.9)")
    p.add_argument("--top-k", type=number(int, 0), default=None,
                   help="top_k of requests that give none (default: 0, off; Ollama's API: 40)")
    p.add_argument("--min-p", type=number(float, 0, 1), default=None,
                   help="min_p of requests that give none (default: 0, off)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="A web origin (https://app.example) whose pages may call this server "
                        "from a browser (repeat it; '*' allows any). Default: none")
    p.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                   help="Another model name requests may give (repeat it); any name that "
                        "is neither this nor the model's is a 404")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="A chat template to use instead of the tokenizer's: a file's path "
                        "(.jinja), or the Jinja text itself")
    p.add_argument("--chat-template-args", type=json_object, default={},
                   help="Arguments of every request's chat template, a JSON object "
                        "(e.g. '{\"enable_thinking\": false}')")
    p.add_argument("--prompt-cache-size", type=number(int, 0), default=10,
                   help="KV caches of recent prompts and replies kept, so a request that "
                        "starts with one (the next turn of a chat) skips its prefill; 0: "
                        "none (default: %(default)s)")
    p.add_argument("--prompt-cache-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="The most memory those caches take, e.g. 2GB (default: no limit "
                        "but --prompt-cache-size)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="Also keep those caches in this folder, so they outlive the "
                        "server (and its memory's few entries): an agent's next turn, or "
                        "the same conversation after a restart, prefills only its new "
                        "tokens. Kept per model, adapter and routing")
    p.add_argument("--prompt-cache-disk-bytes", type=byte_size, default=10 * 2**30,
                   metavar="SIZE", help="The most the folder holds; the least recently "
                                        "used entries go first (default: 10GB)")
    p.add_argument("--prompt-cache-scope", choices=SCOPES, default="key",
                   help="Whose cached prefixes a request reuses, and so can learn of "
                        "through cached_tokens: key (the same API key; the default), "
                        "client (the same address), shared (everyone's)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_draft_arguments(p)  # a request decoded alone speculates (edgemoe.serving.engine)
    StreamOptions.add_arguments(p)  # each batch row keeps its own routing state
    return tool_parser(p, "server")


def byte_size(text: str) -> int:
    from .streaming.budget import BudgetError, parse_budget

    try:
        size = parse_budget(text, 0)
    except BudgetError:
        size = 0
    if size < 1 or not any(c.isalpha() for c in text):
        raise argparse.ArgumentTypeError(f"expected a size like 2GB or 512MB, got {text!r}")
    return size


def build(args) -> Tuple[Engine, Server]:
    """Load the model on the engine thread; the HTTP-side server over it."""
    from .mlx_backend.loader import load

    options = StreamOptions.from_args(args)
    template = chat_template(args.chat_template)
    # a template given here brings its own tool-call format (mlx-lm infers it from the
    # template): the tool_parser_type a converted pack saved named its own template's
    tokenizer_config = {"chat_template": template, "tool_parser_type": None} if template \
        else None

    def load_model():
        return load(args.model, options, return_config=True,
                    tokenizer_config=tokenizer_config)

    cache_size = args.prompt_cache_size
    if cache_size and not options.routing.allows_prompt_cache:
        # a cached prefix would need the routing its prerouter predicted to be kept too
        log.warning("the prompt cache is off with %s routing", options.routing)
        cache_size = 0
    drafting = args.draft_model or args.prompt_lookup
    engine = Engine(load_model, max_batch=args.max_batch,
                    prefill_step_size=args.prefill_step_size, max_waiting=args.max_waiting,
                    prompt_cache_size=cache_size, prompt_cache_bytes=args.prompt_cache_bytes,
                    load_draft=(lambda tokenizer: load_draft(args, tokenizer)) if drafting
                    else None,
                    prompt_cache_disk=(lambda: disk_cache_of(args, options, engine.store,
                                                             engine.experts_per_token))
                    if args.prompt_cache_dir else None)
    engine.start()
    config = engine.config
    context = int(config.get("max_position_embeddings") or 4096)
    info = engine.store.info()
    server = Server(engine, model_id=str(args.model or "edgemoe-fine"),
                    context_length=context,
                    vocab_size=config.get("vocab_size"), default_max_tokens=args.max_tokens,
                    allowed_hosts=allowed_hosts(args.host, args.allowed_host),
                    send_timeout_s=args.send_timeout, aliases=tuple(args.model_alias),
                    template_args=args.chat_template_args,
                    sampling_defaults={k: v for k, v in (
                        ("temperature", args.temp), ("top_p", args.top_p),
                        ("top_k", args.top_k), ("min_p", args.min_p)) if v is not None},
                    model_type=str(config.get("model_type", "")),
                    model_bytes=sum(f.stat().st_size for f in info.files if f.exists()))
    server.prompt_cache_scope = args.prompt_cache_scope
    server.experts_per_token = engine.experts_per_token  # /metrics, Ollama's /api/show
    server.routing = routing_report(options.routing, engine.experts_per_token)
    return engine, server


def disk_cache_of(args, options, store, experts=None):
    """The prompt cache's folder on disk for the loaded model: keyed by its files (each
    one's path, size and modification time: a re-converted model gets a fresh cache), its
    adapter and its routing, with its experts per token when reduced (`experts`: an
    ExpertsPerToken; a cache made with 8 of 8 is never used with 4 of 8)."""
    from .serving.disk_cache import DiskPromptCache

    files = sorted((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in store.info().files if f.exists())
    identity = {"model": str(args.model or "edgemoe-fine"), "files": files,
                "adapter": options.adapter_path, "routing": str(options.routing)}
    if experts is not None and experts.reduced:  # (the model's own k keys as before)
        identity["experts_per_token"] = str(experts)
    return DiskPromptCache(Path(args.prompt_cache_dir), identity,
                           args.prompt_cache_disk_bytes)


def chat_template(value):
    """--chat-template's template: the file it names, or the text it is (logged: which)."""
    if not value:
        return None
    path = Path(value).expanduser()
    if "\n" not in value and "{" not in value:
        if not path.is_file():
            raise SystemExit(f"--chat-template: {value!r} is neither a file (no such file) "
                             f"nor a Jinja template (no {{% or {{{{ in it)")
        log.info("chat template: the file %s", path)
        return path.read_text(encoding="utf-8")
    log.info("chat template: the text given on the command line (%d characters)",
             len(value))
    return value


def allowed_hosts(host: str, extra):
    """The Host names a server bound to `host` answers: None (any) for a wildcard bind."""
    if host in ("0.0.0.0", "::") or "*" in (extra or ()):
        return None
    return sorted({host, *LOCAL_HOSTS, *(extra or ())})


def end_streams_on_exit(uvicorn_server, server: Server):
    """On a stop signal, streams in flight end with an error event before uvicorn waits
    for their connections to close (else they would be cut without one)."""
    handle_exit = uvicorn_server.handle_exit

    def handle(sig, frame):
        if server.loop is not None and not server.loop.is_closed():
            server.loop.call_soon_threadsafe(server.close_streams)
        handle_exit(sig, frame)

    uvicorn_server.handle_exit = handle


def listening_socket(host: str, port: int, send_buffer: int) -> socket.socket:
    """The server's socket. Its send buffer, which the connections it accepts inherit,
    is fixed (no autotuning to megabytes), so a client that stops reading blocks its
    stream soon, and --send-timeout can free its batch row."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    return sock


@tool("server")
def main(argv=None):
    import uvicorn

    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if (error := draft_error(args)) is not None:
        parser.error(error)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pin_mmap_threshold()  # before any thread: big blocks given back whole (limits.py)
    engine, server = build(args)
    freeze_loaded_objects()
    if not engine.leader:  # a group's other hosts compute; host 0 serves (edgemoe.distributed)
        log.info("%s: following host 0 of the group; it serves HTTP",
                 engine.share.watch.me)
        engine.thread.join()
        return
    info = engine.store.info()
    log.info("%s: %d MoE layers, %d slots per layer (%.1f MB of %.1f MB of experts), %s "
             "routing; context %d; serving on http://%s:%d", info.path, info.moe_layers,
             info.slots_per_layer, info.slot_bytes / 1e6, info.expert_bytes / 1e6,
             describe_routing(args.routing, engine.experts_per_token),
             server.context_length, args.host, args.port)
    POLICY.allow_client, POLICY.timeout_s = args.allow_client_templates, args.template_timeout
    try:
        config = uvicorn.Config(make_app(server, cors_origins=args.cors_origin), log_level=args.log_level.lower(),
                                timeout_graceful_shutdown=5, timeout_keep_alive=5,
                                http=guarded_protocol(args.request_timeout,
                                                      args.max_connections,
                                                      args.max_client_connections))
        sock = listening_socket(args.host, args.port, args.send_buffer)
        uvicorn_server = uvicorn.Server(config)
        stop_within(uvicorn_server, STOP_TIMEOUT_S)
        end_streams_on_exit(uvicorn_server, server)
        uvicorn_server.run(sockets=[sock])
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
