"""Where work that names an image goes on a cluster whose nodes each pull for themselves: pure
decisions (no I/O, no clock), their inputs each node's room and whether it holds the image.

A node "holds" an image when its store has it, when it is pulling it, or when the head has just
sent it work naming it (its pull is about to start there). A pull costs seconds to minutes and
a node's disk, a placement elsewhere nothing: so a new session goes to a node that holds its
image whenever one has room for its first step, and otherwise where the engine would put any
new session (the node with the most free cores), which then pulls it. A prewarm over ``count``
nodes takes those that hold the image first (nothing to fetch there), then the emptiest.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """One node as these decisions see it: its index in the engine's CPU pool, what it has free,
    and whether it holds the image asked for."""

    index: int
    free_cores: int
    free_mem_gb: float
    holds: bool


def holds(names: Iterable[str], present: Collection[str]) -> bool:
    """Whether a node whose images are ``present`` holds an image known by any of ``names``
    (the name asked for and the reference it parses as: ``pulls.stored_names``)."""
    return any(n in present for n in names)


def session_node(nodes: Iterable[NodeRoom], cores: int, mem_gb: float) -> int | None:
    """The node a new session naming an image starts on: of the nodes holding it that have
    ``cores`` free and ``mem_gb`` of memory to spare, the one with the most free cores (then
    memory; then the lowest index); None when no such node exists (placed as any new session)."""
    best: NodeRoom | None = None
    for n in nodes:
        if not n.holds or n.free_cores < cores or n.free_mem_gb < mem_gb:
            continue
        if best is None or (n.free_cores, n.free_mem_gb, -n.index) > (best.free_cores, best.free_mem_gb, -best.index):
            best = n
    return best.index if best is not None else None


def prewarm_nodes(nodes: Iterable[NodeRoom], count: int) -> list[int]:
    """The ``count`` nodes a prewarm pulls an image on and starts its sandboxes on: those that
    hold it first, then those with the most free cores and memory (the lowest index on a tie);
    fewer when there are fewer nodes."""
    ranked = sorted(nodes, key=lambda n: (not n.holds, -n.free_cores, -n.free_mem_gb, n.index))
    return [n.index for n in ranked[:max(0, count)]]
