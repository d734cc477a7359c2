"""Ops that work along some dims of a tensor and independently along the rest.

    core dims   the dims the op reads across (cumsum's dim, sort's dim, a matrix's last two,
                a pool's spatial dims, the dims a reduction removes): never sharded
    other dims  each element's result depends only on its own slice: Shard(d) in, Shard(d')
                out, where d' is d renumbered past the core dims the output drops

Every DTensor arg of the input's rank (a backward's grad_output, gather's index) shards
with the input on the same dim, and only when its size there is the input's (a shorter
index's rows are not the input's rows); every other arg is Replicate. A linear op (cumsum, flip, roll, triu, avg pooling, ...) also passes a sum or
avg Partial. Strategies are listed per mesh axis and the chooser picks the cheapest.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.tensor.ops.registry import NoStrategy, OpCall, Sharding, aten, register
from plait.tensor.placement import Partial, Replicate, Shard, _NormPartial
from plait.tensor.spec import DTensorSpec

CoreFn = Callable[[OpCall, int], set[int]]


def _norm(dims, nd: int) -> set[int]:
    if dims is None:
        return set(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    return {d % max(nd, 1) for d in dims} if nd else set()


def dims_at(pos: int, name: str, default=None, *, empty_is_all: bool = False) -> CoreFn:
    """The core dims are the op's `dim` argument (an int or a list)."""

    def core(call: OpCall, nd: int) -> set[int]:
        dims = call.arg(pos, name, default)
        if empty_is_all and isinstance(dims, (list, tuple)) and not dims:
            dims = None
        return _norm(dims, nd)

    return core


def last(k: int) -> CoreFn:
    """The core dims are the last k (a matrix's two, a pool's spatial dims)."""
    return lambda call, nd: set(range(max(nd - k, 0), nd))


def every(call: OpCall, nd: int) -> set[int]:
    return set(range(nd))


def core_rule(core: CoreFn, *, linear: bool = False, appends: bool = False, batched: bool = False):
    """The rule of an op whose core dims `core(call, ndim)` gives (see the module note).
    `appends`: an output with more dims than the input has the new ones last (unfold).
    `batched`: leading batch dims are shared by args of other ranks too (linear algebra:
    householder_product's tau (b, k) beside its input (b, m, n)): each shards with them."""

    def rule(call: OpCall) -> Sharding:
        if call.outs is None and not call.returns:
            raise NoStrategy  # no meta kernel (geqrf): how many outputs, of what shape, is unknown
        specs: list[DTensorSpec] = call.specs
        first = specs[0]
        nd = first.ndim
        cores = core(call, nd)
        outs = [o for o in (call.outs or ())]
        R = Replicate()
        strategies = [((R,) * len(specs), (R,) * len(outs))]
        for d in range(nd):
            if d in cores or first.shape[d] == 1:
                continue
            if any(s.ndim == nd and s.shape[d] != first.shape[d] for s in specs):
                continue  # gather's index shorter than self: its rows are not self's rows
            if batched:
                if any(d >= s.ndim - 1 or s.shape[d] != first.shape[d] for s in specs):
                    continue
                ins = (Shard(d),) * len(specs)
            else:
                ins = tuple(Shard(d) if s.ndim == nd else R for s in specs)
            out_p = []
            for o in outs:
                od = d if o is None or o.dim() == nd or (appends and o.dim() > nd) else d - sum(c < d for c in cores)
                if o is not None and ((o.dim() > nd and not appends) or od >= o.dim() or o.shape[od] != first.shape[d]):
                    break
                out_p.append(Shard(od))
            else:
                strategies.append((ins, tuple(out_p)))
        if linear:
            for p in {p for s in specs for p in s.placements if type(p) is Partial and p.is_linear()}:
                strategies.append((tuple(p if s.ndim == nd else R for s in specs), (p,) * len(outs)))
        return call.choose(strategies)

    return rule


def _reg(core: CoreFn, *ops, linear: bool = False, appends: bool = False, batched: bool = False) -> None:
    register(*[op for op in ops if op is not None])(core_rule(core, linear=linear, appends=appends,
                                                              batched=batched))


def _op(name: str):
    packet, overload = name.rsplit(".", 1)
    return getattr(getattr(aten, packet, None), overload, None)


# scans along one dim
_reg(dims_at(1, "dim"), aten.cumsum.default, aten.cumsum_.default, linear=True)
_reg(dims_at(1, "dim"), aten.cumprod.default, aten.cumprod_.default, aten.logcumsumexp.default,
     aten.cummax.default, aten.cummin.default)
# orderings and selections along one dim (values and indices: the dim is whole, so local
# indices are global ones)
_reg(dims_at(1, "dim", -1), aten.sort.default)
_reg(lambda call, nd: _norm(call.kwargs.get("dim", -1), nd), aten.sort.stable)
_reg(dims_at(2, "dim", -1), aten.topk.default, aten.kthvalue.default)
_reg(dims_at(1, "dim", -1), aten.mode.default, aten.median.dim, aten.nanmedian.dim)
_reg(every, aten.median.default, aten.nanmedian.default)
# reductions plait's reduction rules do not shard across
_reg(dims_at(1, "dim", empty_is_all=True), aten.logsumexp.default, aten.prod.dim_int, aten.all.dim,
     aten.any.dim, aten.all.dims, aten.any.dims, aten.var_mean.correction, aten.std_mean.correction,
     aten.nansum.default)
_reg(dims_at(2, "dim", empty_is_all=True), aten.norm.ScalarOpt_dim)
_reg(every, aten.prod.default, aten.all.default, aten.any.default, aten.norm.Scalar,
     aten.count_nonzero.default)
_reg(dims_at(1, "dim", empty_is_all=True), aten.count_nonzero.dim_IntList)
# reorderings (linear: they move values)
_reg(dims_at(1, "dims"), aten.flip.default, linear=True)
_reg(lambda call, nd: _norm(call.arg(2, "dims") or None, nd), aten.roll.default, linear=True)
_reg(last(2), aten.triu.default, aten.tril.default, aten.triu_.default, aten.tril_.default, linear=True)
# linear algebra: batch dims shard, each matrix is whole
_reg(last(2), *[_op(n) for n in """linalg_cholesky_ex.default cholesky.default cholesky_inverse.default
    cholesky_solve.default linalg_inv_ex.default _linalg_det.default _linalg_slogdet.default
    linalg_eig.default _linalg_eigh.default _linalg_svd.default linalg_qr.default linalg_lu.default
    linalg_lu_factor_ex.default linalg_lu_solve.default linalg_solve_triangular.default
    _linalg_solve_ex.default triangular_solve.default linalg_householder_product.default
    linalg_matrix_exp.default linalg_ldl_factor_ex.default linalg_ldl_solve.default geqrf.default
    ormqr.default lu_unpack.default linalg_pinv.atol_rtol_tensor""".split()], batched=True)
# pooling and resampling: batch and channel dims shard, the spatial dims are whole
for _k in (1, 2, 3):
    _reg(last(_k), *[_op(n.format(k=_k)) for n in """avg_pool{k}d.default adaptive_avg_pool{k}d.default
        _adaptive_avg_pool{k}d.default _adaptive_avg_pool{k}d_backward.default avg_pool{k}d_backward.default
        upsample_nearest{k}d.default _upsample_nearest_exact{k}d.default""".split()], linear=True)
    _reg(last(_k), *[_op(n.format(k=_k)) for n in """adaptive_max_pool{k}d.default
        max_pool{k}d_with_indices.default max_pool{k}d_with_indices_backward.default
        adaptive_max_pool{k}d_backward.default fractional_max_pool{k}d.default max_unpool{k}d.default
        reflection_pad{k}d.default replication_pad{k}d.default""".split()])
# (their backwards take the input's global size as a list: TODO(rule) with the local size)
_reg(last(1), aten.upsample_linear1d.default, linear=True)
_reg(last(2), aten.upsample_bilinear2d.default, aten.upsample_bicubic2d.default,
     aten._upsample_bilinear2d_aa.default, aten._upsample_bicubic2d_aa.default, linear=True)
_reg(last(3), aten.upsample_trilinear3d.default, linear=True)
# gather/scatter along one dim: the others shard with the index
_reg(dims_at(1, "dim"), aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_.src,
     aten.scatter_.value, aten.scatter_reduce.two, aten.scatter_reduce_.two, aten.index_fill.int_Scalar,
     aten.index_fill.int_Tensor, aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor,
     aten.index_reduce.default, aten.index_reduce_.default, aten.index_add.default, aten.index_add_.default,
     aten.index_copy.default, aten.index_copy_.default)
_reg(dims_at(1, "dim"), aten.scatter_add.default, aten.scatter_add_.default, linear=True)


# FFTs transform their dims whole; every other dim is a batch dim (linear)
_reg(dims_at(1, "dim"), aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default, linear=True)
# diagonals: the two dims it walks are whole (the output's last dim is the diagonal)
_reg(lambda call, nd: _norm([call.arg(2, "dim1", 0), call.arg(3, "dim2", 1)], nd), aten.diagonal.default,
     aten.diagonal_copy.default, linear=True)
_reg(every, aten.diag.default, aten.trace.default, linear=True)
_reg(dims_at(2, "dim", -1), aten.linalg_cross.default)
_reg(dims_at(1, "dim"), aten.narrow_copy.default, linear=True)
_reg(dims_at(1, "dimension"), aten.unfold.default, linear=True, appends=True)  # a view: windows last
# renorm rescales each slice along `dim` by its norm over every other dim
_reg(lambda call, nd: set(range(nd)) - _norm(call.arg(2, "dim"), nd), aten.renorm.default, aten.renorm_.default)


def constant_pad_core(call: OpCall, nd: int) -> set[int]:
    pad = call.arg(1, "pad")
    return set(range(nd - len(pad) // 2, nd))


_reg(constant_pad_core, aten.constant_pad_nd.default)




@register(aten.histc.default)
def histc_rule(call: OpCall) -> Sharding:
    """histc over a fixed range (min < max): each rank counts its piece, the counts add up, a
    sum Partial (torch's). With min == max the range is the data's own: gathered first."""
    spec = call.specs[0]
    lo, hi = float(call.arg(2, "min", 0)), float(call.arg(3, "max", 0))
    R = Replicate()
    strategies = [((R,), (R,))]
    if lo < hi:
        strategies += [((Shard(d),), (Partial("sum"),)) for d in range(spec.ndim) if spec.shape[d] > 1]
    return call.choose(strategies)


@register(aten.dist.default)
def dist_rule(call: OpCall) -> Sharding:
    """dist(a, b, p) = ||a - b||_p: a and b sharded alike on any dim -> each rank's norm of
    its piece, a p-norm Partial (torch's: the result is Partial, one all-reduce when read).
    Broadcast shapes and p <= 0 are Replicate."""
    a, b = call.specs
    p = float(call.arg(2, "p", 2))
    R = Replicate()
    strategies = [((R, R), (R,))]
    if a.shape == b.shape and p > 0:
        for d in range(a.ndim):
            if a.shape[d] > 1:
                strategies.append(((Shard(d), Shard(d)), (_NormPartial(p),)))
    return call.choose(strategies)


__all__ = ["core_rule", "dims_at", "dist_rule", "every", "histc_rule", "last"]
