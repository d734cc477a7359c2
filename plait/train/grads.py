"""The gradients between backward and the optimizer step in plait train: Partial sums made
whole, and this rank's share of the global norm.

    backward -> reduce_partial_grads: a Partial(sum) DTensor grad (a replicated parameter fed
    by sharded activations) all-reduced to Replicate, once -> grad_norm_sq on every rank ->
    one world all-reduce of the shares (the trainer's) = the whole model's squared norm ->
    clip -> step
"""

from __future__ import annotations

import torch

from plait.tensor import DTensor, Replicate


def reduce_partial_grads(params: list[torch.nn.Parameter]) -> None:
    """Make every grad complete: a Partial(sum) DTensor grad (a replicated parameter fed by
    sharded activations, e.g. a SequenceParallel norm's weight) is all-reduced to Replicate, so
    the grad norm below and the optimizer see the sum, reduced once."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl
                                                    for pl in g.placements])


def grad_norm_sq(params: list[torch.nn.Parameter], *, world: int, pp: int) -> torch.Tensor:
    """This rank's share of the squared global grad norm: summed over the world it is the whole
    model's. A piece held identically by k ranks (a Replicate axis, or a plain tensor every rank
    of a pipeline stage holds) adds 1/k of its square on each."""
    total = torch.zeros((), dtype=torch.float64, device=params[0].device if params else None)
    per_stage = world // pp
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            copies = per_stage // mesh.size()
            for axis, pl in enumerate(g.placements):
                if pl.is_replicate():
                    copies *= mesh.size(axis)
            local = g.to_local()
        else:
            copies, local = per_stage, g
        total += local.double().pow(2).sum() / copies
    return total
