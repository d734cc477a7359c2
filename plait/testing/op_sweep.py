"""Every op of torch's `op_db` on DTensors against the same op on one device.

    for each OpInfo, dtype (float32, complex64), sample input (torch's own generators):
        reference   = op(plain inputs); grads of every float input (a seeded cotangent)
        for each layout of the inputs (all Replicate; one input Shard(d) for each dim d;
                                       every input Shard(0); every input Shard(-1)):
            outputs = op(DTensor inputs) -> full_tensor()      == reference (1e-4)
            grads   = backward through them -> full_tensor()   == reference grads

An op passes when every sample in every layout matches; it fails on the first mismatch
or error, whose text is kept. Random ops compare values too: plait draws the global
tensor from one generator state, as one process does (ops/random_ops.py); `api`s that do
not (torch's DTensor) compare shapes only for them. Ops with no tensor input (factories)
are "n/a": there is no DTensor to give them. `api` is the DTensor module under test
(`plait.tensor`, or torch's `torch.distributed.tensor` in the benchmark beside it): the
sweep runs on every rank of `mesh` (same ops, same order) and needs `expecttest`
(torch's op_db imports it). PLAIT_SWEEP_RAISE=1 raises an op's error instead of keeping
its first line (to debug one op on one rank).
"""

from __future__ import annotations

import itertools
import os
import random as pyrandom
import time
import warnings
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.utils import _pytree as pytree

PASS, FAIL, NA = "pass", "fail", "n/a"
_DIFFERENTIABLE = (torch.float32, torch.float64, torch.complex64, torch.complex128)
TOL = dict(rtol=1e-4, atol=1e-4)


@dataclass
class OpResult:
    name: str
    status: str = PASS
    detail: str = ""
    samples: int = 0
    layouts: int = 0
    fallback: int = 0  # calls through plait's fallback (plait only)
    seconds: float = 0.0
    ops_seen: set = field(default_factory=set)


def op_infos(names: list[str] | None = None) -> list:
    """torch's OpInfos, by `name` or `name.variant` (all when `names` is None)."""
    from torch.testing._internal.common_methods_invocations import op_db

    infos = [o for o in op_db if names is None or full_name(o) in names]
    if names is not None:
        unknown = set(names) - {full_name(o) for o in infos}
        if unknown:
            raise ValueError(f"no OpInfo named {sorted(unknown)}")
    return infos


def full_name(info) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}


def is_random(info) -> bool:
    return (info.name in ("bernoulli", "multinomial", "normal", "rand_like", "randn_like", "randint_like",
                          "uniform", "exponential", "geometric", "cauchy", "log_normal")
            or "dropout" in info.name or info.name in ("nn.functional.rrelu",))


def layouts(tensors: list[torch.Tensor], api) -> list[list]:
    """Placements per tensor input for each layout tried (see the module note)."""
    R, S = api.Replicate(), api.Shard
    base = [R] * len(tensors)
    out = [base]
    for k, t in enumerate(tensors):
        for d in range(t.dim()):
            if t.shape[d] > 1 and t.dtype != torch.bool:
                out.append(base[:k] + [S(d)] + base[k + 1:])
    for d in (0, -1):
        both = [S(d % t.dim()) if t.dim() and t.shape[d] > 1 and t.dtype != torch.bool else R for t in tensors]
        if both not in out:
            out.append(both)
    return out


def _cotangent(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if t.is_complex():
        parts = [torch.randn(t.shape, generator=g, device="cpu") for _ in range(2)]  # generator g is a CPU one
        return torch.complex(*parts).to(t.dtype).to(t.device)
    return torch.randn(t.shape, generator=g, device="cpu").to(t.dtype).to(t.device)


def _loss(outs: list[torch.Tensor]) -> torch.Tensor | None:
    """A real scalar of every differentiable output (sum of out * seeded cotangent)."""
    total = None
    for k, o in enumerate(outs):
        if not (isinstance(o, torch.Tensor) and o.requires_grad and o.dtype in _DIFFERENTIABLE):
            continue
        term = (o * _cotangent(o, 100 + k)).sum()
        term = term.real if term.is_complex() else term
        total = term if total is None else total + term
    return total


def _leaves(tree) -> list:
    return [x for x in pytree.tree_leaves(tree)]


def _compare(got, want, what: str) -> str:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{what}: got {type(got).__name__}, expected a tensor"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{what}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
        try:
            torch.testing.assert_close(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg(),
                                       equal_nan=True, **TOL)
        except AssertionError as e:
            return f"{what}: {str(e).splitlines()[0]} {str(e).splitlines()[-1] if len(str(e).splitlines()) > 1 else ''}"
        return ""
    if isinstance(want, float) and isinstance(got, float):
        return "" if (got == want or abs(got - want) <= 1e-4 * max(1.0, abs(want))
                      or (got != got and want != want)) else f"{what}: {got} != {want}"
    return "" if got == want else f"{what}: {got!r} != {want!r}"


def _agree(mesh, signature: str) -> bool:
    """Whether every rank of the mesh built the same sample (its shapes and dtypes)."""
    import torch.distributed as dist

    mine = torch.tensor([zlib.crc32(signature.encode())], dtype=torch.int64, device=mesh.device_type)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(both[0]) == -int(both[1])


def run_sample(info, sample, mesh, api, *, backward: bool, random: bool) -> tuple[int, str]:
    """(layouts tried, first mismatch or error text, "" if none). Every rank runs the same
    collectives: each stage's verdict (forward, backward, comparison) is agreed on before
    the next, so a rank that found nothing stops where another found something."""
    args = [sample.input, *sample.args]
    kwargs = dict(sample.kwargs)
    flat, tree = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors or any(t.is_sparse or t.layout != torch.strided for t in tensors):
        return 0, NA
    torch.manual_seed(7)
    try:
        want = info.op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a sample torch itself rejects is not a DTensor question
        want = NA
    if not _agree(mesh, "na" if want is NA else "ok"):
        return 0, NA
    if want is NA:
        return 0, NA
    want_leaves = _leaves(want)
    diff_inputs = [t for t in tensors if t.requires_grad]
    want_grads = None
    if backward and diff_inputs and not random:
        try:
            loss = _loss(want_leaves)
            if loss is not None:
                want_grads = torch.autograd.grad(loss, diff_inputs, allow_unused=True)
        except Exception:  # noqa: BLE001 - no derivative formula: compare forward only
            want_grads = None
    tried = 0
    for placements in layouts(tensors, api):
        tried += 1
        problem = _one_layout(info, flat, tree, tensors, placements, mesh, api, want_leaves, want_grads, random)
        if problem:
            return tried, f"layout {[str(p) for p in placements]}{problem}"
    return tried, ""


def _stage(mesh, problem: str) -> str:
    """This rank's problem, or a note that another rank had one (agreed on every rank)."""
    if _agree(mesh, "failed" if problem else "ok"):
        return problem
    return problem or ": another rank failed here (its text is in its own run)"


def _one_layout(info, flat, tree, tensors, placements, mesh, api, want_leaves, want_grads, random) -> str:
    it = iter(placements)
    dt_inputs, new_flat = [], []
    for x in flat:
        if isinstance(x, torch.Tensor):
            d = api.distribute_tensor(x.detach(), mesh, [next(it)])
            if x.requires_grad:
                d.requires_grad_(True)
            dt_inputs.append(d)
            new_flat.append(d)
        else:
            new_flat.append(x)
    dargs, dkwargs = pytree.tree_unflatten(new_flat, tree)
    torch.manual_seed(7)

    def forward():
        got = info.op(*dargs, **dkwargs)
        return [g.full_tensor() if isinstance(g, api.DTensor) else g for g in _leaves(got)]

    full, problem = _caught(forward, "")
    problem = _stage(mesh, problem)
    if problem:
        return problem
    got_grads = None
    if want_grads is not None:
        def backward():
            grads = torch.autograd.grad(_loss(full), [d for d, t in zip(dt_inputs, tensors) if t.requires_grad],
                                        allow_unused=True)
            return [g.full_tensor() if isinstance(g, api.DTensor) else g for g in grads]

        got_grads, problem = _caught(backward, " backward")
        problem = _stage(mesh, problem)
        if problem:
            return problem
    return _stage(mesh, _check(info, full, want_leaves, got_grads, want_grads, random, api))


def _caught(fn, where: str):
    """(fn(), "") or (None, the error's first line), kept as the op's failure text
    (PLAIT_SWEEP_RAISE=1: raised)."""
    try:
        return fn(), ""
    except Exception as e:  # noqa: BLE001
        if os.environ.get("PLAIT_SWEEP_RAISE"):
            raise
        return None, f"{where}: {type(e).__name__}: {_first_line(e)}"


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def _check(info, full, want_leaves, got_grads, want_grads, random, api) -> str:
    if len(full) != len(want_leaves):
        return f": {len(full)} outputs, expected {len(want_leaves)}"
    values = api.same_random_values or not random
    for k, (g, w) in enumerate(zip(full, want_leaves)):
        if isinstance(w, torch.Tensor) and (not values or info.name in UNINITIALIZED):
            if not isinstance(g, torch.Tensor) or (g.shape, g.dtype) != (w.shape, w.dtype):
                return f": output {k}: {getattr(g, 'shape', g)} != {tuple(w.shape)} {w.dtype}"
            continue
        problem = _compare(g, w, f"output {k}")
        if problem:
            return f": {problem}"
    for k, (g, w) in enumerate(zip(got_grads or (), want_grads or ())):
        if w is None:
            continue
        if g is None:
            return f": grad {k} is None"
        problem = _compare(g, w, f"grad {k}")
        if problem:
            return f" backward: {problem}"
    return ""


def sweep_op(info, mesh, api, *, dtypes=(torch.float32, torch.complex64), max_samples: int = 4,
             backward: bool = True, fallback_counts=None) -> OpResult:
    """One OpInfo on DTensors over `mesh` (see the module note)."""
    result = OpResult(full_name(info))
    start = time.perf_counter()
    before = dict(fallback_counts()) if fallback_counts else {}
    random = is_random(info)
    ran = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in dtypes:
            if dtype not in info.supported_dtypes("cpu"):
                continue
            torch.manual_seed(0)
            pyrandom.seed(0)
            try:
                samples = list(itertools.islice(info.sample_inputs("cpu", dtype, requires_grad=backward
                                                                   and info.supports_autograd), max_samples))
            except Exception:  # noqa: BLE001 - torch's generator needs what this build lacks
                samples = []
            signature = repr([[(tuple(t.shape), t.dtype) for t in pytree.tree_leaves((s.input, s.args, s.kwargs))
                               if isinstance(t, torch.Tensor)] for s in samples])
            if not _agree(mesh, signature):
                continue  # a generator drew from an unseeded source: not the same calls on every rank
            for sample in samples:
                tried, problem = run_sample(info, sample, mesh, api, backward=backward, random=random)
                if problem == NA:
                    continue
                ran = True
                result.samples += 1
                result.layouts += tried
                if problem:
                    result.status, result.detail = FAIL, f"{dtype}: {problem}"
                    break
            if result.status == FAIL:
                break
    if not ran and result.status == PASS:
        result.status = NA
    if fallback_counts:
        after = fallback_counts()
        result.fallback = sum(after.values()) - sum(before.values())
        result.ops_seen = {k for k in after if after[k] != before.get(k, 0)}
    result.seconds = time.perf_counter() - start
    return result


def sweep(names: list[str] | None, mesh, api, **kwargs) -> list[OpResult]:
    return [sweep_op(info, mesh, api, **kwargs) for info in op_infos(names)]


def plait_api() -> SimpleNamespace:
    from plait.tensor import DTensor, Replicate, Shard, distribute_tensor

    return SimpleNamespace(DTensor=DTensor, Replicate=Replicate, Shard=Shard,
                           distribute_tensor=distribute_tensor, same_random_values=True)


def sweep_on_rank(names: list[str] | None, mesh_shape: tuple[int, ...], **kwargs) -> list[OpResult]:
    """The sweep with plait's DTensor on this rank of a mesh of `mesh_shape` (for
    plait.testing.run_distributed); each op's fallback calls counted."""
    from plait.device_mesh import init_device_mesh
    from plait.tensor.debug import fallback_counts

    mesh = init_device_mesh("cpu", mesh_shape)
    return sweep(names, mesh, plait_api(), fallback_counts=fallback_counts, **kwargs)


__all__ = ["FAIL", "NA", "PASS", "OpResult", "full_name", "op_infos", "plait_api", "sweep", "sweep_on_rank",
           "sweep_op"]
