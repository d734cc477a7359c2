"""One stage's backward for one microbatch: full (B), or input grad (I) then weight grad (W).

    B:  outputs, output grads --autograd.backward--> input grads and param .grad, graph freed
    I:  outputs, output grads --autograd.grad(inputs, retain_graph)--> input grads
            + what W needs: the gradient entering each *boundary* node, captured by a prehook
    W:  boundary nodes, captured grads --autograd.grad(params)--> param .grad, graph freed

Boundary nodes. Call C the autograd nodes with a path to a stage input (the part I must run).
Everything else reachable from the outputs either leads only to parameters (the weight-only
region) or to nothing that needs a grad. A parameter's gradient enters its weight-only region
at two kinds of start points: a node in C with an edge into the region (`mm` in `x @ w.t()`:
I runs it for `x`'s grad only; W runs it again for `w`'s), or a stage output whose node is
not in C at all (an output computed from parameters alone). Parameters sharing a start point
form one group; W runs one `autograd.grad` per group, from its start points to its params.

Invariants that make this exact (tests compare against one full backward):
- A C start point's captured grad is complete: everything upstream of a node in C is in C,
  and I runs all of C, so the prehook fires once with the sum of all contributions.
- W never double counts: if one C start point lies downstream of another in the same group,
  W's pass would feed it a second, partial gradient through C; a prehook replaces whatever
  arrives with the captured value. Weight-only start points get nothing during I, so need none.
- Memory: I keeps the graph (`retain_graph=True`) because W re-runs the boundary nodes, whose
  saved tensors (e.g. `x` for `w`'s grad) must survive. The caller drops its outputs after I,
  so what stays alive is what the boundary nodes reach, until W releases it: a microbatch's
  activations are held from F to W, as the simulator counts them.
- A stage whose inputs need no grad (the first stage) has no C: I does nothing (nobody
  needs its input grad) and W runs the whole backward, as torch does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def full_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """B: accumulate every param's grad and return the grads of `inputs` (None if unused).

    `inputs` are the stage's own leaves (received activations): their `.grad` is read and
    cleared, so it is not kept alive past the send."""
    roots, root_grads = _differentiable(outputs, grads)
    if roots:
        torch.autograd.backward(roots, root_grads)
    result = []
    for x in inputs:
        result.append(x.grad if x.requires_grad else None)
        if x.requires_grad and x.is_leaf:
            x.grad = None
    return result


@dataclass
class _Group:
    """Params whose weight-only regions share start points, and those start points."""

    params: list[torch.Tensor] = field(default_factory=list)
    boundary: list[Node] = field(default_factory=list)  # start points in C
    roots: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)  # outside C


@dataclass
class WeightGradState:
    """What I leaves for W. `deferred` holds a whole backward when the stage had no C."""

    groups: list[_Group]
    captured: dict[Node, tuple[torch.Tensor | None, ...]]
    deferred: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradState]:
    """I: return the grads of `inputs` (None where unused or not differentiable) and the state
    `backward_weight` needs. Param `.grad`s are not touched."""
    roots, root_grads = _differentiable(outputs, grads)
    wanted = [x for x in inputs if x.requires_grad]
    if not roots or not wanted:
        return [None] * len(inputs), WeightGradState([], {}, (roots, root_grads))
    parents = _reverse_edges(get_gradient_edge(r).node for r in roots)  # leaves too
    in_c = _ancestors([get_gradient_edge(x).node for x in wanted], parents, stop=set())
    groups = _group_params(roots, root_grads, params, parents, in_c)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def capture(node: Node):
        def hook(grad_outputs):
            captured[node] = tuple(grad_outputs)

        return hook

    handles = [n.register_prehook(capture(n)) for g in groups for n in g.boundary]
    try:
        found = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    by_id = {id(x): g for x, g in zip(wanted, found)}
    return [by_id.get(id(x)) for x in inputs], WeightGradState(groups, captured)


def backward_weight(state: WeightGradState) -> None:
    """W: accumulate the param grads that `backward_input` left out, then free the graph."""
    if state.deferred is not None:
        roots, root_grads = state.deferred
        if roots:
            torch.autograd.backward(roots, root_grads)
        state.deferred = None
        return
    for group in state.groups:
        edges: list[GradientEdge] = []
        seeds: list[torch.Tensor] = []
        for node in group.boundary:
            for i, g in enumerate(state.captured.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        for edge, g in group.roots:
            edges.append(edge)
            seeds.append(g)
        if not edges:
            continue
        clamps = []
        if len(group.boundary) > 1:  # see the module note: no double counting through C
            for node in group.boundary:
                saved = state.captured.get(node)
                clamps.append(node.register_prehook(lambda _, saved=saved: saved))
        try:
            # retain_graph: another group's pass may run through nodes this one runs
            # (a shared param used twice); the graph is freed when `state` is dropped.
            found = torch.autograd.grad(
                edges, group.params, seeds, retain_graph=True, allow_unused=True
            )
        finally:
            for h in clamps:
                h.remove()
        with torch.no_grad():
            for p, g in zip(group.params, found):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.detach().clone()  # g may alias a grad that was sent
                else:
                    p.grad.add_(g)
    state.groups.clear()
    state.captured.clear()


def _differentiable(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs that carry a graph, each with its grad (ones for a scalar loss)."""
    roots, root_grads = [], []
    for out, g in zip(outputs, grads):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            roots.append(out)
            root_grads.append(torch.ones_like(out) if g is None else g)
    return roots, root_grads


def _reverse_edges(start) -> dict[Node, list[Node]]:
    """node -> the nodes that feed it a gradient, over the graph reachable from `start`."""
    parents: dict[Node, list[Node]] = {}
    todo = []
    for node in start:
        if node is not None and node not in parents:
            parents[node] = []
            todo.append(node)
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _ancestors(
    nodes: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]
) -> set[Node]:
    """`nodes` and every node upstream of them (toward the outputs), not entering `stop`."""
    seen = {n for n in nodes if n in parents}
    todo = list(seen)
    while todo:
        for up in parents[todo.pop()]:
            if up not in seen and up not in stop:
                seen.add(up)
                todo.append(up)
    return seen


def _group_params(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor],
    params: Sequence[torch.Tensor],
    parents: dict[Node, list[Node]],
    in_c: set[Node],
) -> list[_Group]:
    """Union params whose weight-only regions meet at a start point (see the module note)."""
    root_edges = [get_gradient_edge(r) for r in roots]
    root_at = {}
    for k, edge in enumerate(root_edges):
        if edge.node not in in_c:
            root_at.setdefault(edge.node, []).append(k)
    owner: dict[object, int] = {}  # start point key -> group index
    groups: list[_Group] = []
    for p in params:
        if not p.requires_grad:
            continue
        node = get_gradient_edge(p).node
        if node not in parents:
            continue  # unused by this microbatch: its grad stays as it is
        region = _ancestors([node], parents, stop=in_c)
        starts: list[object] = [up for n in region for up in parents[n] if up in in_c]
        starts += [("root", k) for n in region for k in root_at.get(n, ())]
        hit = sorted({owner[s] for s in starts if s in owner})
        if hit:
            target = hit[0]
            for other in hit[1:]:  # merge groups joined by this param
                moved = groups[other]
                groups[target].params += moved.params
                for key, idx in owner.items():
                    if idx == other:
                        owner[key] = target
                groups[other] = _Group()
        else:
            target = len(groups)
            groups.append(_Group())
        groups[target].params.append(p)
        for s in starts:
            owner[s] = target
    for key, idx in owner.items():
        if isinstance(key, tuple):
            k = key[1]
            groups[idx].roots.append((root_edges[k], root_grads[k]))
        else:
            groups[idx].boundary.append(key)
    return [g for g in groups if g.params]
