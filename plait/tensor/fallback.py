"""Ops without a sharding rule, and the meta run that gives every op its global shapes.

    fallback:  every DTensor arg not yet Replicate -> Replicate (collectives)
               -> op on full local tensors (a seeded random op from one generator state)
               -> outputs wrapped as Replicate; args written in place get their piece back

Right for any op whose result does not depend on which rank runs it, and slow: a full
gather of every sharded or partial argument on every rank. What happens is the policy's
(`PLAIT_DTENSOR_FALLBACK`, or `plait.tensor.debug.fallback_policy`):

    warn    (default) a warning once per op, naming it, the placements and the bytes gathered
    error   NotImplementedError naming the op and the placements: a test asserts there is none
    silent  neither

and `plait.tensor.debug.fallback_counts()` counts every call per op, whatever the policy.
`meta_outputs` runs the op on meta tensors of the global shapes: the output shapes,
strides and dtypes a rule's placements are attached to.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import torch

from plait.tensor import redistribute as redist
from plait.tensor.placement import Replicate
from plait.tensor.spec import DTensorSpec

POLICIES = ("warn", "error", "silent")
_policy = os.environ.get("PLAIT_DTENSOR_FALLBACK", "warn")
if _policy not in POLICIES:
    raise ValueError(f"PLAIT_DTENSOR_FALLBACK={_policy!r}: expected one of {', '.join(POLICIES)}")
_warned: set = set()
counts: Counter = Counter()  # op name -> calls through the fallback (plait.tensor.debug reads it)


def set_policy(policy: str) -> str:
    """Set what a fallback does (see the module note); returns the previous policy."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"fallback policy {policy!r}: expected one of {', '.join(POLICIES)}")
    previous, _policy = _policy, policy
    return previous


def meta_outputs(op, args, kwargs) -> list | None:
    """The op's outputs computed on meta tensors of the global shapes, flattened (None
    where the op returns None); None when the op cannot run on meta tensors."""
    try:
        margs = [_to_meta(a) for a in args]
        mkwargs = {k: ("meta" if k == "device" else False if k == "pin_memory" else _to_meta(v))
                   for k, v in kwargs.items()}
        out = op(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, data-dependent shape, ...
        return None
    return flatten(out)


def _to_meta(a):
    from plait.tensor.dtensor import DTensor

    if type(a) is DTensor:
        s = a._spec
        return torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
    if type(a) in (list, tuple):
        return type(a)(_to_meta(e) for e in a)
    return a


def flatten(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        flat: list = []
        for o in out:
            if isinstance(o, torch.Tensor) or o is None:
                flat.append(o)
            elif isinstance(o, (tuple, list)):
                flat.extend(flatten(o))
        return flat
    return []


class FallbackPlan:
    __slots__ = ("op", "mesh", "steps", "positions", "written", "returns", "specs", "seeded")
    fast = None  # never dispatch's fast path
    fast_inplace = None

    def __init__(self, op, mesh, specs, positions, written, returns) -> None:
        self.op, self.mesh, self.specs = op, mesh, specs
        replicate = tuple(Replicate() for _ in range(mesh.ndim))
        self.steps = tuple(redist.plan_for(s, replicate) or None for s in specs)
        self.positions, self.written, self.returns = positions, written, returns
        self.seeded = torch.Tag.nondeterministic_seeded in op.tags

    def _report(self, name: str) -> None:
        moved = [(str(list(s.placements)), s.nbytes) for s, st in zip(self.specs, self.steps) if st]
        placements = ", ".join(str(list(s.placements)) for s in self.specs)
        if _policy == "error":
            raise NotImplementedError(
                f"plait.tensor has no sharding rule for {name} (DTensor args placed {placements}) "
                "and the fallback is off (PLAIT_DTENSOR_FALLBACK=error): add a rule with "
                "plait.tensor.register_sharding, or redistribute the args to Replicate first")
        _warned.add(self.op)
        cost = sum(n for _, n in moved)
        warnings.warn(
            f"plait.tensor has no sharding rule for {name}: args placed {placements}; "
            f"gathering {len(moved)} of them ({cost:,} bytes each call) and running it on full "
            "tensors on every rank (correct, but slow; add a rule with "
            "plait.tensor.register_sharding; PLAIT_DTENSOR_FALLBACK=error makes this an error)",
            stacklevel=4)

    def run(self, args, kwargs, dts):
        from plait.tensor.dispatch import _substitute, _wrap_seq
        from plait.tensor.dtensor import wrap

        name = str(self.op)
        counts[name] += 1
        if _policy != "silent" and (_policy == "error" or self.op not in _warned):
            self._report(name)
        mesh = self.mesh
        locals_ = [d._local_tensor if s is None else redist.run(d._local_tensor, s, mesh)
                   for d, s in zip(dts, self.steps)]
        la, lk = _substitute(args, kwargs, self.positions, locals_)
        if self.seeded and lk.get("generator") is None:
            # every rank draws the same values (a Replicate result), as one process would
            from plait.tensor.ops.random_ops import sync_generator
            sync_generator(mesh, locals_[0].device)
        if any(spec.dtype.is_complex for spec in self.specs):
            from plait.tensor.dispatch import math_bits_live
            with math_bits_live():
                out = self.op(*la, **lk)
        else:
            out = self.op(*la, **lk)
        for k in self.written:  # give each written arg its piece of the new value
            if self.steps[k] is not None:
                spec = self.specs[k]
                back = redist.plan(spec.shape, [Replicate()] * mesh.ndim, spec.placements,
                                   mesh.shape, mesh.get_coordinate())
                dts[k]._local_tensor.copy_(redist.run(locals_[k], back, mesh))
        if self.returns is not None:
            r = self.returns
            return dts[r[0]] if len(r) == 1 else (tuple(dts[k] for k in r) if r else None)
        if isinstance(out, torch.Tensor):
            return wrap(out, _replicate_spec(mesh, out))
        if isinstance(out, (tuple, list)):
            tensors = [o for o in flatten(out)]
            specs = iter([None if o is None else _replicate_spec(mesh, o) for o in tensors])
            return _wrap_seq(out, specs)
        return out


_specs: dict = {}


def _replicate_spec(mesh, t: torch.Tensor) -> DTensorSpec:
    key = (mesh, tuple(t.shape), t.stride(), t.dtype)
    spec = _specs.get(key)
    if spec is None:
        if len(_specs) > 4096:
            _specs.clear()
        spec = _specs[key] = DTensorSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)),
                                         tuple(t.shape), t.stride(), t.dtype)
    return spec


def plan(op, mesh, specs, positions, written, returns) -> FallbackPlan:
    return FallbackPlan(op, mesh, specs, positions, written, returns)


__all__ = ["POLICIES", "FallbackPlan", "counts", "flatten", "meta_outputs", "plan", "set_policy"]
