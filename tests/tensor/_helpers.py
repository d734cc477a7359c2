"""Helpers for DTensor parity tests: exact DTensors of any placements, and one check that
runs an op on DTensors and on plain tensors and compares values and gradients.

Inputs are small integers (exact in float32 and bfloat16), so building a Partial (pieces
that sum / average / max to the value) is exact, and only the op's own arithmetic can
make the two runs differ. Tolerances (see each test module's docstring):

    float32   atol 1e-4, rtol 1e-4: sharded sums add the same terms in another order
    bfloat16  atol 6e-2, rtol 6e-2: bf16 keeps 8 significant bits (a step of 2^-7
              relative); a sharded op rounds each rank's partial result to bf16 before the
              cross-rank reduction rounds again, the reference rounds once: a few steps on
              values of magnitude <= ~4
"""

from __future__ import annotations

import itertools
import random

import torch

from plait.device_mesh import init_device_mesh
from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from plait.tensor.placement import chunk_offset, has_strided

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=6e-2)}


def mesh_for(world_size: int, two_d: bool = False):
    if two_d:
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("a",))


def ints(*shape, seed: int = 0, low: int = -4, high: int = 5, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def exact_dtensor(full: torch.Tensor, mesh, placements, *, salt: int = 0, requires_grad: bool = False) -> DTensor:
    """A DTensor with exactly `full` as its value: Shards are torch.chunk pieces, Partials
    are integer pieces that reduce to the value (every rank computes the same noise)."""
    coordinate = mesh.get_coordinate()
    local = full.detach().clone()
    for axis, p in enumerate(placements):
        n, me = mesh.size(axis), coordinate[axis]
        if type(p) is Shard:
            size, start = chunk_offset(local.size(p.dim), n, me)
            local = local.narrow(p.dim, start, size).clone()
        elif isinstance(p, Partial):
            g = torch.Generator().manual_seed(1000 + 17 * salt + axis)
            noise = [torch.randint(-3, 4, local.shape, generator=g).to(local.dtype) for _ in range(n)]
            if p.reduce_op == "sum":
                local = local - sum(noise[1:]) if me == 0 else noise[me]
            elif p.reduce_op == "avg":
                noise[-1] = -sum(noise[:-1])
                local = local + noise[me]
            elif p.reduce_op == "max":
                local = local if me == 0 else local - noise[me].abs() - 1
            else:
                local = local if me == 0 else local + noise[me].abs() + 1
    shape, stride = tuple(full.shape), tuple(full.contiguous().stride())
    x = DTensor.from_local(local.contiguous(), mesh, placements, shape=shape, stride=stride)
    if requires_grad:
        x = x.detach().requires_grad_()
    return x


def placements_1d(ndim: int, partial: bool = True) -> list:
    ps = [Replicate()] + [Shard(d) for d in range(ndim)]
    return ps + [Partial("sum")] if partial else ps


# How many placement combinations a test runs per world size. 1 and 2 ranks run them all
# (1 is free; 2 is the cheapest real one); 3 ranks (uneven pieces) and 4 ranks (empty
# pieces) pay 2 and 4 ms per Gloo collective on this 2-core machine, so they run a seeded
# sample: the rules are per mesh axis and the same at every world size, what 3 and 4
# ranks add is the uneven and empty pieces, which every sampled case has.
SAMPLE = {1: None, 2: None, 3: 8, 4: 6}


def combos(ndims: list[int], mesh, *, partial: bool = True, limit: int | None = -1, seed: int = 0) -> list:
    """Placement tuples for each input: every combination, or a seeded sample of `limit`
    (default: SAMPLE for the mesh's size); every rank draws the same."""
    if limit == -1:
        limit = SAMPLE.get(mesh.size())
    per_input = []
    for nd in ndims:
        axis_options = placements_1d(nd, partial)
        per_input.append(list(itertools.product(axis_options, repeat=mesh.ndim)))
    every = list(itertools.product(*per_input))
    if limit is not None and len(every) > limit:
        every = random.Random(seed).sample(every, limit)
    return every


def piece(full: torch.Tensor, spec) -> torch.Tensor:
    """This rank's piece of `full` under `spec` (Shard: its chunk; Replicate: all; an
    interleaved _StridedShard: its chunk of every block, as distribute_tensor cuts it)."""
    if has_strided(spec.placements):
        return distribute_tensor(full, spec.mesh, spec.placements).to_local()
    out = full
    for d, (start, size) in enumerate(zip(spec.local_offset, spec.local_shape)):
        out = out.narrow(d, start, size)
    return out


def assert_value(dt, expected: torch.Tensor, tol: dict, label: str) -> None:
    """`dt`'s global value is `expected`: each rank checks its own piece, with no
    communication unless `dt` is Partial (then it is reduced first)."""
    assert isinstance(dt, DTensor), f"{label}: got {type(dt).__name__}, not a DTensor"
    assert dt.shape == expected.shape and dt.dtype == expected.dtype, \
        f"{label}: {tuple(dt.shape)} {dt.dtype} != {tuple(expected.shape)} {expected.dtype}"
    if dt._spec.has_partial():
        got, want = dt.full_tensor(), expected
    else:
        got, want = dt.to_local(), piece(expected, dt._spec)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{label}: {m}")


def local_loss(dt, weight: torch.Tensor) -> torch.Tensor:
    """A local term whose gradient, summed over ranks as DTensor semantics say, is the
    gradient of (value * weight).sum(): a Partial output's grad is Replicate."""
    spec = dt._spec
    grads = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    return (dt.to_local(grad_placements=grads) * piece(weight, spec.with_placements(grads))).sum()


def check(fn, inputs: list[torch.Tensor], placements, mesh, *, grad: bool = True, dtype=torch.float32,
          tol: dict | None = None, what: str = "", frozen: tuple[int, ...] = ()) -> None:
    """fn on DTensors (inputs with `placements`) equals fn on plain tensors; so do the grads
    of every floating input (except those `frozen`) when `grad`."""
    tol = tol or TOL[dtype]
    plain = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    wants = [grad and t.is_floating_point() and i not in frozen for i, t in enumerate(plain)]
    refs = [t.clone().requires_grad_(w) for t, w in zip(plain, wants)]
    expected = fn(*refs)
    dts = [exact_dtensor(t, mesh, p, salt=i, requires_grad=w)
           for i, (t, p, w) in enumerate(zip(plain, placements, wants))]
    got = fn(*dts)
    label = f"{what} placements={[[str(q) for q in p] for p in placements]} dtype={dtype}"
    outs_e = expected if isinstance(expected, (tuple, list)) else (expected,)
    outs_g = got if isinstance(got, (tuple, list)) else (got,)
    assert len(outs_e) == len(outs_g), label
    for k, (e, g) in enumerate(zip(outs_e, outs_g)):
        if isinstance(e, torch.Tensor):
            assert_value(g, e.detach(), tol, f"{label} output {k}")
        else:
            assert e == g, f"{label} output {k}: {g} != {e}"
    if not grad:
        return
    floats = [(e, g) for e, g in zip(outs_e, outs_g)
              if isinstance(e, torch.Tensor) and e.is_floating_point() and e.requires_grad]
    if not floats:
        return
    weights = [ints(*e.shape, seed=99 + k, dtype=e.dtype) for k, (e, _) in enumerate(floats)]
    sum((e * w).sum() for (e, _), w in zip(floats, weights)).backward()
    sum(local_loss(g, w) for (_, g), w in zip(floats, weights)).backward()
    for i, (r, d) in enumerate(zip(refs, dts)):
        if r.grad is None:
            continue
        assert d.grad is not None, f"{label}: input {i} got no gradient"
        assert_value(d.grad, r.grad, tol, f"{label} grad of input {i}")


__all__ = ["TOL", "assert_value", "check", "combos", "exact_dtensor", "ints", "local_loss", "mesh_for",
           "piece", "placements_1d"]
