"""loss_parallel: cross-entropy on logits sharded along the class (vocabulary) dim,
without gathering them.

    with loss_parallel():
        loss = F.cross_entropy(logits, target)   # logits DTensor (N, V) Shard(1) / (B, V, ...) Shard(1)
        loss.backward()                          # grad: DTensor with the logits' placements

Forward, per rank on its classes [lo, lo + V_r) (x: (M, V_r), M = samples):
    m    = all_reduce_max(max_c x)                    (M, 1)  shift for exp
    lse  = m + log(all_reduce_sum(sum_c exp(x - m)))  (M, 1)  so logp = x - lse, locally
    pick = all_reduce_sum([logp_t if t in my range], [sum_c w_c logp_c])   (M, 2) one call
    loss_i = (1-eps) * -w_t * logp_t + eps/V * -sum_c w_c logp_c           (0 if t is ignored)
    mean: sum_i loss_i / sum_i w_t (valid i); sum; none   — F.cross_entropy's formulas
Backward is local (no communication): with p = exp(logp) and g_i the upstream grad,
    dx_ik = g_i * (p_ik * ((1-eps) w_t + eps/V * W) - (1-eps) w_t [k = t] - eps/V * w_k),  W = sum_c w_c
Probability targets (float, same shape as the logits) use q = (1-eps) target + eps/V:
    loss_i = -sum_c w_c q_c logp_c, dx_ik = g_i * (p_ik * sum_c w_c q_c - w_k q_k), mean over M.

Also handled: F.nll_loss on class-sharded log-probabilities, and F.log_softmax over the
sharded dim (one all-reduce in backward for sum_c grad). Inside the context these
functions are intercepted with a TorchFunctionMode when their input is a DTensor; others
run as usual. Unlike torch, backward may run after the context has exited.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode

from plait import comm
from plait.tensor import traced
from plait.tensor.conversions import redistribute_local
from plait.tensor.dtensor import DTensor, wrap
from plait.tensor.placement import Replicate, Shard
from plait.tensor.spec import DTensorSpec

_CE = inspect.signature(F.cross_entropy)
_NLL = inspect.signature(F.nll_loss)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute cross_entropy / nll_loss / log_softmax on class-sharded DTensors in place."""
    with _LossParallelMode():
        yield


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy or func is F.nll_loss:
            bound = (_CE if func is F.cross_entropy else _NLL).bind(*args, **kwargs)
            bound.apply_defaults()
            if isinstance(bound.arguments["input"], DTensor):
                return _loss(func is F.nll_loss, **bound.arguments)
        elif func is F.log_softmax or func is torch.log_softmax or func is torch.Tensor.log_softmax:
            x = args[0] if args else kwargs.get("input")
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(x, DTensor) and isinstance(dim, int) and x.ndim and _sharded_on(x, dim % x.ndim) \
                    and kwargs.get("dtype") is None and len(args) <= 2:
                return _log_softmax(x, dim % x.ndim)
        return func(*args, **kwargs)


def _all_reduce(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """In place through plait.comm eagerly; c10d's functional op while torch.compile traces."""
    if traced.is_traced(t):
        return traced.all_reduce(t, group, op)
    comm.all_reduce(t, group=group, op=op)
    return t


def _sharded_on(x: DTensor, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in x.placements)


def _class_axis(x: DTensor, dim: int, *, strict: bool = True) -> int | None:
    """The one mesh axis that shards `dim`; the others must be Replicate."""
    dim %= max(x.ndim, 1)
    axes = [a for a, p in enumerate(x.placements) if p == Shard(dim)]
    others = [p for a, p in enumerate(x.placements) if a not in axes and p != Replicate()]
    if len(axes) == 1 and not others:
        return axes[0]
    if not strict:
        return None
    raise ValueError(f"loss_parallel needs the logits sharded on their class dim {dim} along exactly one mesh "
                     f"axis and Replicate on the others, got placements {list(x.placements)}")


def _plain(t, x: DTensor, what: str) -> torch.Tensor | None:
    """A target or weight as the whole tensor on every rank (a plain tensor or a Replicate DTensor)."""
    if t is None or not isinstance(t, DTensor):
        return t
    if any(p != Replicate() for p in t.placements):
        if what == "target" and t.placements == x.placements:
            return t.full_tensor()  # probability targets laid out like the logits: gather them
        raise ValueError(f"loss_parallel: the {what} is a DTensor with placements {list(t.placements)}; "
                         "pass it whole (a plain tensor or Replicate)")
    return t.to_local()


@torch._dynamo.allow_in_graph  # one node in a compiled graph (checks included); AOTAutograd traces it
def _loss(is_nll: bool, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
          reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction {reduction!r} is not one of 'mean', 'sum', 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing {label_smoothing} is not in [0, 1]")
    class_dim = 1 if input.ndim >= 2 else 0
    axis = _class_axis(input, class_dim)
    target, weight = _plain(target, input, "target"), _plain(weight, input, "weight")
    n_classes = input.shape[class_dim]
    if weight is not None and tuple(weight.shape) != (n_classes,):
        raise ValueError(f"weight has shape {tuple(weight.shape)} but the logits have {n_classes} classes")
    probs = target.is_floating_point()
    if probs and is_nll:
        raise ValueError("nll_loss takes class-index targets, got a floating-point target")
    want = tuple(input.shape) if probs else tuple(input.shape[:class_dim]) + tuple(input.shape[class_dim + 1:])
    if tuple(target.shape) != want:
        raise ValueError(f"target has shape {tuple(target.shape)}, expected {want} for logits of shape "
                         f"{tuple(input.shape)}")
    opts = (is_nll, class_dim, axis, reduction, ignore_index, float(label_smoothing))
    return _CrossEntropy.apply(input, target.to(input.device), weight, opts)


@torch._dynamo.allow_in_graph
def _log_softmax(x: DTensor, dim: int) -> DTensor:
    return _LogSoftmax.apply(x, dim, _class_axis(x, dim))


class _CrossEntropy(torch.autograd.Function):
    """Cross-entropy (or nll) on class-sharded logits: all-reduces in forward, none in backward."""

    @staticmethod
    def forward(ctx, x: DTensor, target: torch.Tensor, weight: torch.Tensor | None, opts):
        is_nll, class_dim, axis, reduction, ignore_index, eps = opts
        spec = x._spec
        group = spec.mesh.get_group(axis)
        lo, vr = spec.local_offset[class_dim], spec.local_shape[class_dim]
        n_classes = spec.shape[class_dim]
        dtype = torch.promote_types(x.dtype, torch.float32)  # opmath: reduce in at least fp32
        samples = math.prod(want_shape(spec.shape, class_dim))
        xl = x._local_tensor.to(dtype).movedim(class_dim, -1).reshape(samples, vr)  # (M, V_r)
        w_full = None if weight is None else weight.to(dtype)
        w_loc = None if weight is None else w_full[lo:lo + vr]
        if is_nll:
            logp = xl
        else:
            m = xl.amax(-1, keepdim=True) if vr else xl.new_full((xl.shape[0], 1), -torch.inf)
            m = _all_reduce(m, group, "max")
            m = torch.where(torch.isfinite(m), m, 0.0)
            sumexp = (xl - m).exp().sum(-1, keepdim=True)
            sumexp = _all_reduce(sumexp, group)
            logp = xl - (m + sumexp.log())  # (M, V_r)
        wlogp = logp if w_loc is None else logp * w_loc
        if target.is_floating_point():
            q = target.to(dtype).movedim(class_dim, -1).reshape(samples, n_classes)[:, lo:lo + vr]
            q = q * (1 - eps) + eps / n_classes
            both = torch.stack([(wlogp * q).sum(-1), (q if w_loc is None else q * w_loc).sum(-1)], -1)
            both = _all_reduce(both, group)
            per, scale = -both[:, 0], both[:, 1]  # loss_i, sum_c w_c q_c
            total = torch.tensor(float(per.numel()), dtype=dtype, device=per.device)
            valid = None
        else:
            t = target.reshape(-1)
            valid = t != ignore_index
            st = torch.where(valid, t, 0)
            mine = (st >= lo) & (st < lo + vr)
            idx = (st - lo).clamp(0, max(vr - 1, 0)).unsqueeze(-1)
            picked = logp.gather(-1, idx).squeeze(-1) * mine if vr else logp.new_zeros(st.shape)
            if eps:
                both = torch.stack([picked, wlogp.sum(-1)], -1)
                both = _all_reduce(both, group)
                picked, smooth = both[:, 0], both[:, 1]
            else:
                picked = _all_reduce(picked, group)
                smooth = None
            w_t = (torch.ones_like(picked) if w_full is None else w_full[st]) * valid
            per = -(1 - eps) * w_t * picked
            if smooth is not None:
                per = per - eps / n_classes * smooth * valid
            total = w_t.sum()
            scale = w_t
        if reduction == "none":
            out = per.reshape(want_shape(spec.shape, class_dim))
        else:
            out = per.sum() / total if reduction == "mean" else per.sum()
        ctx.save_for_backward(logp, scale, valid, total, target if target.is_floating_point() else st,
                              w_loc)
        ctx.meta = (spec, opts, target.is_floating_point(), n_classes, lo, vr,
                    None if w_full is None else w_full.sum())
        out_spec = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tuple(out.shape),
                               tuple(out.stride()), x.dtype)
        return wrap(out.to(x.dtype), out_spec)

    @staticmethod
    def backward(ctx, grad):
        logp, scale, valid, total, t, w_loc = ctx.saved_tensors
        spec, opts, probs, n_classes, lo, vr, w_sum = ctx.meta
        is_nll, class_dim, axis, reduction, ignore_index, eps = opts
        if isinstance(grad, DTensor):
            grad = grad._local_tensor if grad.placements == (Replicate(),) * spec.mesh.ndim \
                else redistribute_local(grad, (Replicate(),) * spec.mesh.ndim)
        g = grad.to(logp.dtype).reshape(-1) if reduction == "none" else grad.to(logp.dtype).expand(logp.shape[0])
        if reduction == "mean":
            g = g / total
        g = g.unsqueeze(-1)  # (M, 1)
        w_row = 1.0 if w_loc is None else w_loc  # (V_r,)
        if probs:
            q = t.to(logp.dtype).movedim(class_dim, -1).reshape(-1, n_classes)[:, lo:lo + vr]
            q = q * (1 - eps) + eps / n_classes
            dx = g * (logp.exp() * scale.unsqueeze(-1) - w_row * q)
        else:
            g = g * valid.unsqueeze(-1)
            w_t = scale.unsqueeze(-1)  # weight of each sample's target (0 if ignored)
            onehot = torch.zeros_like(logp)
            mine = (t >= lo) & (t < lo + vr)
            if vr:
                onehot.scatter_(-1, (t - lo).clamp(0, vr - 1).unsqueeze(-1), mine.unsqueeze(-1).to(logp.dtype))
            dx = -(1 - eps) * w_t * onehot
            if not is_nll:
                big_w = float(n_classes) if w_sum is None else w_sum
                # the smoothing term's -eps/V * w_k broadcasts over the rows: no (M, V_r) tensor of it
                dx = dx + logp.exp() * ((1 - eps) * w_t + eps / n_classes * big_w) - eps / n_classes * w_row
            dx = g * dx
        local_shape = spec.local_shape
        moved = list(local_shape[:class_dim]) + list(local_shape[class_dim + 1:]) + [vr]
        dx = dx.reshape(moved).movedim(-1, class_dim).to(spec.dtype).contiguous()
        return wrap(dx, spec), None, None, None


def want_shape(shape, class_dim: int) -> tuple[int, ...]:
    return tuple(shape[:class_dim]) + tuple(shape[class_dim + 1:])


class _LogSoftmax(torch.autograd.Function):
    """log_softmax over the sharded dim: two all-reduces forward (max, sum exp), one
    backward (sum of the grad over the classes)."""

    @staticmethod
    def forward(ctx, x: DTensor, dim: int, axis: int):
        spec = x._spec
        group = spec.mesh.get_group(axis)
        xl = x._local_tensor.to(torch.promote_types(x.dtype, torch.float32))
        m = xl.amax(dim, keepdim=True) if xl.shape[dim] else xl.sum(dim, keepdim=True) - torch.inf
        m = _all_reduce(m, group, "max")
        m = torch.where(torch.isfinite(m), m, 0.0)
        s = (xl - m).exp().sum(dim, keepdim=True)
        s = _all_reduce(s, group)
        out = (xl - m - s.log()).to(x.dtype)
        ctx.save_for_backward(out)
        ctx.meta = (spec, dim, group)
        return wrap(out, spec)

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        spec, dim, group = ctx.meta
        g = grad._local_tensor if grad.placements == spec.placements else redistribute_local(grad, spec.placements)
        total = g.to(torch.float32).sum(dim, keepdim=True)
        total = _all_reduce(total, group)
        return wrap((g - out.float().exp() * total).to(spec.dtype), spec), None, None


__all__ = ["loss_parallel"]
