"""A group of hosts as one server: the engine's loop in lockstep.

Run by a group of hosts (--distributed, edgemoe.distributed), host 0 is the leader: it
alone takes requests, samples and decides when a request ends. Every host runs this same
loop in lockstep: at each turn the leader shares the requests that arrived or were
cancelled (`share_turn`), all hosts run the same prefill chunk and decode step (their
MoE layers sum each host's experts), and the leader shares the tokens it chose and the
rows that go on (`follow`). A forward pass that fails on one host leaves the
others waiting inside it, so in a group that is fatal: the engine stops, and the other
hosts' group timeout ends them with an error naming this one.
"""

from typing import List

from ..distributed import GroupError
from .job import Job


def fatal_in_group(engine, e: Exception):
    """In a group, a failed forward pass stops this engine (see above)."""
    if engine.share is None:
        return
    if isinstance(e, GroupError):
        raise e
    raise GroupError(f"{engine.share.watch.me}: a forward pass failed here "
                     f"({type(e).__name__}: {e}); the group cannot go on without "
                     f"this host") from e


SPEC = ("id", "prompt", "max_tokens", "use_prompt_cache")  # what followers need of a job


def share_turn(engine, new: List[Job]):
    """The leader tells the others which requests arrived and which were cancelled
    (or that the server stops); the others add the same. (go on, the ids every host
    drops now: a cancellation that comes later waits for the next turn)."""
    turn = None
    if engine.leader:
        cancelled = [j.id for j in [*engine.pending, *engine.active] if j.cancelled]
        turn = {"stop": engine.stopping.is_set(), "cancelled": cancelled,
                "new": [{k: getattr(j, k) for k in SPEC} for j in new]}
    turn = engine.share.broadcast(turn, "sharing the requests")
    if not engine.leader:
        for spec in turn["new"]:
            engine.pending.append(Job(emit=lambda event: None, **spec))
    return not turn["stop"], set(turn["cancelled"])


def follow(engine, tokens: List[int], keep: List[int]):
    """A follower's step: the leader's tokens for the rows that go on."""
    for i in keep:
        engine.active[i].tokens.append(tokens[i])
        engine.active[i].next_input = tokens[i]
    if len(keep) < len(engine.active):
        engine.keep_rows(keep)
