"""Where DDP touches the autograd graph: a pre-hook on the outputs' nodes, and the walk
that finds which parameters a forward used; and what to tell a user whose graph DDP
cannot reduce as configured.

    forward outputs -> watch_outputs: a pre-hook on each output's grad_fn -> user's loss
    -> backward reaches an output's node first (it is next to the roots)
    -> on_start(): queue the end-of-backward callback on the *outer* graph task, mark
       unused parameters ready -> parameters' grad hooks -> callback

Queuing from the outputs rather than from the first gradient hook matters: a hook may
fire inside a nested (reentrant checkpoint) backward, whose graph task ends long before
the outer one; a callback queued there would run too early. A pre-hook leaves the
outputs themselves untouched (torch's _DDPSink returns new tensors, which must then be
clones, or in-place use of an output breaks: pytorch#60733).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.utils import _pytree as pytree


def watch_outputs(output: object, on_start: Callable[[object], None]) -> list[torch.Tensor]:
    """Call `on_start(grad_outputs)` when a backward reaches a tensor of `output` (any pytree):
    a node pre-hook itself (no wrapper frame per backward), so it must return None.

    Returns those tensors (the roots a parameter must be reachable from to count as
    used): the ones with a grad_fn.
    """
    if isinstance(output, torch.Tensor):  # the common case, without pytree's or a set's frames (every forward)
        if output.grad_fn is None:
            return []
        output.grad_fn.register_prehook(on_start)
        return [output]
    roots = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in {t.grad_fn for t in roots}:
        node.register_prehook(on_start)
    return roots


def reachable_params(roots: Iterable[torch.Tensor], index_of: dict[int, int]) -> set[int]:
    """Indices (via `index_of[id(param)]`) of the parameters whose AccumulateGrad node is
    reachable from `roots`' grad_fns: the parameters this forward used."""
    found: set[int] = set()
    seen: set[torch.autograd.graph.Node] = set()
    stack = []
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif id(t) in index_of:  # the output is a parameter itself
            found.add(index_of[id(t)])
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # set on AccumulateGrad nodes only
        if variable is not None:
            idx = index_of.get(id(variable))
            if idx is not None:
                found.add(idx)
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return found


def unused_message(names: list[str], rank: int, static_graph: bool) -> str:
    """Parameters that got no gradient in a backward that expected all of them."""
    if static_graph:
        return (f"static_graph=True, but on rank {rank} parameters {names} received no gradient "
                "in the previous iteration although they did in the first; the graph is not "
                "static: drop static_graph and pass find_unused_parameters=True")
    return (
        f"DistributedDataParallel: on rank {rank}, parameters {names} received no gradient in "
        "the previous iteration. Pass find_unused_parameters=True if some parameters are "
        "unused in some iterations (a branch taken only sometimes, an output left out of the "
        "loss), or static_graph=True if the same ones are unused every iteration. (Their "
        "buckets were reduced with zeros so that no rank hangs.)"
    )


def twice_message(name: str) -> str:
    """A gradient that arrived after its parameter was already reduced."""
    return (
        f"parameter {name} got its gradient twice in one backward, after it was already "
        "reduced. This happens when a parameter takes part in several reentrant backward "
        "passes (torch.utils.checkpoint with use_reentrant=True) or in a forward run more "
        "than once per backward: pass static_graph=True if the graph is the same every "
        "iteration, or use checkpoint(..., use_reentrant=False)"
    )
