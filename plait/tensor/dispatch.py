"""__torch_dispatch__ for DTensor: look up the call's plan, move inputs, run locally, wrap.

    key = (id(op), token of every DTensor arg's spec, every other arg)    one tuple hash per call
          (a float arg of a pointwise op by its type: its value changes no plan; a spec by
          its int token, so hashing the key runs no Python: see _token)
    plan = cache[key] or planner.build(...)                   rule -> steps + output specs
    run:  local_i = steps_i(dtensor_i local) -> op(locals) -> wrap with the output specs

Steady state a call costs one Python frame (torch_dispatch is DTensor.__torch_dispatch__
itself), the collectives its inputs need (usually none), the local op and one wrapper per
output; specs come from the plan, so no spec is created. `Plan.fast` marks the common case (DTensors only as positional args, nothing
to move, one output) that skips the general bookkeeping; `Plan.fast_inplace` the same for
an op that writes and returns one of its DTensor args. An op that writes an argument
in place returns that same DTensor object.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from plait.tensor import foreach_meshes as by_mesh
from plait.tensor import redistribute as redist
from plait.tensor.dtensor import _NO_KWARGS, _STRIDED, DTensor, _make_wrapper, wrap
from plait.tensor.ops.registry import FLOAT_VALUE_FREE
from plait.tensor.placement import Replicate
from plait.tensor.spec import DTensorSpec

MAX_CACHED = 16384
_plans: dict[tuple, Plan] = {}
_Tensor = torch.Tensor
_current_autograd_node = torch._C._current_autograd_node  # not None inside a backward formula
# set by plait.tensor.experimental.implicit_replication(): plain tensors mixed with DTensors
# in one op are taken as replicated (torch's DTensor._op_dispatcher._allow_implicit_replication)
_allow_implicit_replication = False


def torch_dispatch(cls, op, types, args: tuple = (), kwargs: dict | None = None):
    """DTensor.__torch_dispatch__ (bound below): one frame per op, on the optimizer's hot path."""
    if kwargs is None:
        kwargs = _NO_KWARGS
    dts: list[DTensor] = []
    key: list = [id(op)]  # an OpOverload hashes in Python; its id in C
    append = key.append
    free = id(op) in FLOAT_VALUE_FREE  # a float argument is keyed by its type, not its value
    try:
        for a in args:
            t = type(a)
            if t is DTensor:
                dts.append(a)
                spec = a._spec
                token = spec._token
                append(token if token is not None else _token(spec))
                append(id(spec.mesh))  # see _key
            elif t is list or t is tuple:
                append(_seq_key(op, a, dts, free))
            elif isinstance(a, _Tensor):
                append(_key(op, a, dts))
            else:
                append(float if free and t is float else a)
        if kwargs:
            for k, v in kwargs.items():
                append(k)
                append(float if free and type(v) is float else _key(op, v, dts, free))
    except _PlainTensor:  # a _foreach_ op's lists mix kinds, or under implicit_replication()
        groups = by_mesh.split(args, kwargs) if by_mesh.is_foreach(op) else {}
        if len(groups) > 1:  # some indices hold plain tensors only: they run as plain tensors
            return by_mesh.ByMeshPlan(op).run(args, kwargs, dts, groups)
        if not _allow_implicit_replication:
            plain = _first_plain(args, kwargs, many=True)
            if plain is not None and _current_autograd_node() is None:
                raise _mixed(op, plain) from None
        # a plain tensor of one element is a value, the same on every rank (torch's DTensor
        # takes it as Replicate too); so is one a backward formula makes (cummax's, prod's:
        # zeros or an arange of a shape, the same on every rank, where torch's DTensor
        # raises); others under implicit_replication()
        return dispatch(op, *_replicate_plain(args, kwargs))
    key_t = tuple(key)
    try:
        plan = _plans.get(key_t)
    except TypeError:  # an unhashable argument (symbolic sizes while tracing): plan uncached
        return planner.build(op, args, kwargs, dts).run(args, kwargs, dts)
    if plan is None:
        plan = planner.build(op, args, kwargs, dts)
        if len(_plans) >= MAX_CACHED:
            _plans.clear()
        _plans[key_t] = plan
    if plan.fast is not None:
        la = list(args)
        for i, dt in zip(plan.fast, dts):
            la[i] = dt._local if dt._pending is None else dt._local_tensor
        out = plan.raw_op(*la, **kwargs) if kwargs else plan.raw_op(*la)
        spec = plan.out_specs[0]  # dtensor.wrap, inlined: a frame per op is the cost here
        r = _make_wrapper(DTensor, spec.shape, spec.stride, None, None, spec.dtype, _STRIDED, out.device,
                          False, False)
        r._local, r._pending, r._spec = out, None, spec
        return r
    if plan.fast_inplace is not None:
        la = list(args)
        for i, dt in zip(plan.fast_inplace, dts):
            la[i] = dt._local if dt._pending is None else dt._local_tensor
        plan.raw_op(*la, **kwargs) if kwargs else plan.raw_op(*la)
        return dts[plan.returns[0]]
    return plan.run(args, kwargs, dts)


def dispatch(op, args: tuple, kwargs: dict):
    """An op on DTensor arguments, as __torch_dispatch__ runs it."""
    return torch_dispatch(DTensor, op, None, args, kwargs)


DTensor.__torch_dispatch__ = classmethod(torch_dispatch)

# Spec tokens: equal specs (hash and == run in Python) share one int (hashed in C). Tokens
# come from a counter that never restarts, so a token always names specs equal to the one it
# was first given to; forgetting the table (a bound on its size) only costs new tokens.
_tokens: dict[DTensorSpec, int] = {}
_next_token = itertools.count()


def _token(spec: DTensorSpec) -> int:
    token = _tokens.get(spec)
    if token is None:
        if len(_tokens) >= MAX_CACHED:
            _tokens.clear()
        token = _tokens[spec] = next(_next_token)
    spec._token = token
    return token


def _seq_key(op, a, dts: list, free: bool) -> tuple:
    """The key of a list argument, a tuple with one entry per element. A foreach op's lists
    hold its DTensors (keyed as in _key, inlined: one frame per list, not per element) and,
    for a ScalarList, floats that change every step (AdamW's step sizes and bias corrections):
    with `free` those are keyed by their type, as torch's OpSchema leaves non-tensor args out
    of its hash, else every step missed the cache and re-planned every index."""
    key = []
    append = key.append
    for e in a:
        t = type(e)
        if t is DTensor:
            dts.append(e)
            spec = e._spec
            token = spec._token
            append((token if token is not None else _token(spec), id(spec.mesh)))
        elif free and t is float:
            append(float)
        else:
            append(_key(op, e, dts, free))
    return tuple(key)


def _key(op, a, dts: list, free: bool = False):
    t = type(a)
    if t is DTensor:
        dts.append(a)
        # a plan's output specs hold the mesh it was built with: two meshes over the same
        # ranks compare equal, but a result must keep its input's mesh (its root, its groups),
        # so the plan is keyed by the mesh object too (the plan holds it: its id stays unique)
        spec = a._spec
        return (spec._token if spec._token is not None else _token(spec), id(spec.mesh))
    if t is list or t is tuple:
        return _seq_key(op, a, dts, free)
    if free and t is float:
        return float
    if isinstance(a, _Tensor):
        if a.dim() != 0:
            if (_allow_implicit_replication or by_mesh.is_foreach(op) or a.numel() == 1
                    or _current_autograd_node() is not None):
                raise _PlainTensor
            raise _mixed(op, a)
        return (_Tensor, a.dtype, a.device)
    return a


class _PlainTensor(Exception):
    """A plain tensor of dim > 0 met while keying a call under implicit replication, or in a
    _foreach_ op's lists (foreach_meshes: indices that hold plain tensors only run as such)."""


def _mixed(op, a: torch.Tensor) -> ValueError:  # a TypeError would turn into NotImplemented for x + t
    return ValueError(
        f"{op}: got a torch.Tensor of shape {tuple(a.shape)} mixed with DTensors; convert it "
        "with DTensor.from_local or distribute_tensor first (only 0-dim tensors mix), or "
        "run the op under plait.tensor.experimental.implicit_replication()")


def _first_plain(args: tuple, kwargs: dict, many: bool = False) -> torch.Tensor | None:
    """The first plain tensor of dim > 0 (with `many`: of more than one element, or None)."""
    return next((e for a in (*args, *kwargs.values()) for e in (a if type(a) in (list, tuple) else (a,))
                 if type(e) is not DTensor and isinstance(e, _Tensor) and e.dim() != 0
                 and not (many and e.numel() == 1)), None)


def _replicate_plain(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """args and kwargs with every plain tensor of dim > 0 wrapped as a Replicate DTensor on
    the call's mesh (torch's `_allow_implicit_replication`). The wrapper shares the tensor's
    storage, so an op that writes it in place writes the plain tensor."""
    found = [e for a in (*args, *kwargs.values()) for e in (a if type(a) in (list, tuple) else (a,))
             if type(e) is DTensor]
    assert found, "dispatch reached without a DTensor argument"
    mesh = found[0]._spec.mesh
    replicate = (Replicate(),) * mesh.ndim

    def convert(a):
        t = type(a)
        if t is list or t is tuple:
            return t(convert(e) for e in a)
        if t is not DTensor and isinstance(a, _Tensor) and a.dim() != 0:
            local = a.detach()
            return wrap(local, DTensorSpec(mesh, replicate, tuple(local.shape), tuple(local.stride()), local.dtype))
        return a

    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


class Plan:
    """Everything about one call signature that does not depend on tensor values."""

    __slots__ = ("op", "raw_op", "mesh", "steps", "out_specs", "local_fn", "positions", "returns",
                 "moved", "is_view", "fast", "fast_inplace", "math_bits")

    def __init__(self, op, mesh, steps, out_specs, local_fn, positions, returns, moved, math_bits=False) -> None:
        self.op, self.raw_op, self.mesh = op, op._op, mesh
        self.steps = steps  # per DTensor arg: redistribute steps, or None to use it as it is
        self.out_specs = out_specs  # per flat tensor output: DTensorSpec (None: output is None)
        self.local_fn = local_fn
        self.positions = positions  # where each DTensor sits: (None, i) arg, (i, j) in list arg i
        self.returns = returns  # None: wrap outputs; else the DTensor args returned (by index)
        self.moved = moved  # (index, new spec) of written args that move, in place, first
        rets = op._schema.returns
        self.is_view = bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write
        simple = (local_fn is None and returns is None and not moved and not self.is_view
                  and len(rets) == 1 and len(out_specs) == 1 and all(s is None for s in steps)
                  and all(where is None for where, _ in positions))
        self.fast = tuple(i for _, i in positions) if simple else None  # arg index of each DTensor
        # the in-place twin (an optimizer's x.mul_(b).add_(g)): returns the one DTensor it writes
        inplace = (local_fn is None and returns is not None and len(returns) == 1 and not moved
                   and all(s is None for s in steps) and all(where is None for where, _ in positions))
        self.fast_inplace = tuple(i for _, i in positions) if inplace else None
        self.math_bits = math_bits  # complex values: the local op runs with conj/neg bits live
        if math_bits:
            self.fast = self.fast_inplace = None

    def run(self, args: tuple, kwargs: dict, dts: list[DTensor]):
        mesh = self.mesh
        locals_ = []
        for dt, steps in zip(dts, self.steps):
            # the property inlined: a foreach op's lists put hundreds of DTensors through here
            local = dt._local if dt._pending is None else dt._local_tensor
            locals_.append(local if steps is None else redist.run(local, steps, mesh))
        for k, spec in self.moved:
            _move_in_place(dts[k], locals_[k], spec, self.op)
        la, lk = _substitute(args, kwargs, self.positions, locals_)
        if self.math_bits:
            with math_bits_live():
                out = self.local_fn(la, lk) if self.local_fn is not None else self.raw_op(*la, **lk)
        else:
            out = self.local_fn(la, lk) if self.local_fn is not None else self.raw_op(*la, **lk)
        if self.returns is not None:
            r = self.returns
            return dts[r[0]] if len(r) == 1 else (tuple(dts[k] for k in r) if r else None)
        specs = self.out_specs
        if isinstance(out, _Tensor):
            r = wrap(out, specs[0])
            if self.is_view:
                r._aliased = True  # shares its local with another DTensor: never moved in place
            return r
        if isinstance(out, (tuple, list)):
            return _wrap_seq(out, iter(specs), self.is_view)
        return out


_CONJ, _NEG = torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative
_is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


@contextlib.contextmanager
def math_bits_live():
    """Run local ops with the Conjugate and Negative dispatch keys live again.

    __torch_dispatch__ runs with every key above Python excluded, these two included, so
    a kernel that makes a conj or neg view inside (linalg_pinv's mH, a complex backward)
    would read the view's raw values: pinv of a complex Replicate DTensor came out wrong.
    Eager runs them with the keys live; so does this. Only complex calls pay for it."""
    conj, neg = _is_excluded(_CONJ), _is_excluded(_NEG)
    _set_excluded(_CONJ, False)
    _set_excluded(_NEG, False)
    try:
        yield
    finally:
        _set_excluded(_CONJ, conj)
        _set_excluded(_NEG, neg)


def _move_in_place(dt: DTensor, local, spec: DTensorSpec, op) -> None:
    """Give `dt` new placements (its global value and metadata unchanged) before an
    in-place op that cannot run on its old ones, e.g. a Partial grad's masked_fill_."""
    if dt._aliased:
        raise ValueError(
            f"{op} writes in place into a DTensor view with placements {dt.placements}, which the "
            f"op needs as {spec.placements}; moving it would detach it from the tensor it views. "
            "Redistribute the base tensor first")
    dt._local, dt._pending, dt._spec = local, None, spec


def _wrap_seq(out, specs, aliased: bool = False):
    """Wrap a tuple/list result (nested once, as aten returns them) with the flat specs."""
    items = []
    for o in out:
        if isinstance(o, torch.Tensor):
            r = wrap(o, next(specs))
            r._aliased = aliased
            items.append(r)
        elif isinstance(o, (list, tuple)):
            items.append(_wrap_seq(o, specs, aliased))
        else:
            if o is None:
                next(specs)
            items.append(o)
    return type(out)(items) if type(out) in (tuple, list) else out


def _substitute(args, kwargs, positions, locals_):
    """args and kwargs with each DTensor replaced by its local tensor (lists copied)."""
    la = list(args)
    lk = kwargs
    copied: set = set()
    for (where, i), local in zip(positions, locals_):
        if type(where) is str:  # a kwarg (i is its index in a list, or None)
            if lk is kwargs:
                lk = dict(kwargs)
            if i is None:
                lk[where] = local
            else:
                if (where,) not in copied:
                    lk[where] = list(lk[where])
                    copied.add((where,))
                lk[where][i] = local
        elif where is None:
            la[i] = local
        else:
            if where not in copied:
                la[where] = list(la[where])
                copied.add(where)
            la[where][i] = local
    return la, lk


# planner imports Plan from this module; bound as a module so either may load first
from plait.tensor import planner  # noqa: E402

__all__ = ["Plan", "dispatch", "math_bits_live", "torch_dispatch"]
