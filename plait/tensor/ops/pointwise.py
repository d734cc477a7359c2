"""Pointwise ops (unary, binary, ternary, in-place, with broadcasting).

For one mesh axis the strategies are: all Replicate; for each output dim d, Shard(d)
for every input whose aligned dim has the output's size (a broadcast input, size 1 or
missing, stays Replicate); and, for linear ops, Partial patterns. A pattern is the set
of argument positions that may be Partial together, every other DTensor Replicate:

    add, sub, copy_, lerp       (0, 1)          x_P + y_P = (x + y)_P
    mul                         (0,), (1,)      x_P * y_R = (x * y)_P
    div                         (0,)
    addcmul                     (0, 1), (0, 2)  addcdiv (0, 1)
    where(cond, a, b)           (1, 2)
    neg, clone, to, detach ...  (0,)

A pattern only applies when every position in it holds a DTensor (x_P + 1 is not
(x + 1)_P), and only to the linear reduce ops sum and avg.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.tensor.ops.registry import (
    FLOAT_VALUE_FREE,
    OpCall,
    Sharding,
    aten,
    partial_ops,
    partials,
    register,
)
from plait.tensor.placement import Partial, Replicate, Shard, _StridedShard
from plait.tensor.spec import DTensorSpec

UNARY = """abs acos acosh asin asinh atan atanh bitwise_not ceil cos cosh deg2rad digamma erf erfc
erfinv exp exp2 expm1 floor frac isinf isnan isneginf isposinf lgamma log log10 log1p log2
logical_not logit nan_to_num neg positive rad2deg reciprocal relu round rsqrt sgn sigmoid sign
signbit sin sinc sinh sqrt square tan tanh trunc gelu silu mish hardswish hardsigmoid elu
leaky_relu softplus hardtanh relu6 celu selu threshold clamp clamp_min clamp_max pow fill zero
_to_copy clone detach alias lift_fresh bitwise_left_shift bitwise_right_shift""".split()

BINARY = """add sub rsub mul div maximum minimum fmax fmin eq ne lt le gt ge logical_and logical_or
logical_xor bitwise_and bitwise_or bitwise_xor atan2 fmod remainder floor_divide copysign hypot
xlogy nextafter heaviside lerp addcmul addcdiv where masked_fill copy gelu_backward silu_backward
sigmoid_backward tanh_backward threshold_backward leaky_relu_backward hardtanh_backward
elu_backward softplus_backward hardswish_backward hardsigmoid_backward mish_backward
logit_backward native_dropout_backward""".split()

# single overloads (their packets also hold non-pointwise overloads, e.g. max.dim), from torch
# 2.13's DTensor pointwise list, and the complex math bits: conj / neg views and their resolves
OVERLOADS = """__ilshift__.Scalar __ilshift__.Tensor __irshift__.Scalar __irshift__.Tensor __ixor__.Scalar
__ixor__.Tensor __lshift__.Scalar __lshift__.Tensor __rshift__.Scalar __rshift__.Tensor
__xor__.Scalar __xor__.Tensor _conj.default angle.default clip.Tensor clip.default clip_.Tensor
clip_.default conj_physical.default conj_physical_.default float_power.Scalar
float_power.Tensor_Scalar float_power.Tensor_Tensor float_power_.Scalar float_power_.Tensor
frexp.Tensor gcd.default i0.default i0_.default igamma.default igamma_.default igammac.default
igammac_.default isfinite.default lcm.default ldexp.Tensor ldexp_.default max.other min.other
mvlgamma.default mvlgamma_.default polygamma.default polygamma_.default softshrink.default
special_airy_ai.default special_bessel_j0.default special_bessel_j1.default
special_bessel_y0.default special_bessel_y1.default special_chebyshev_polynomial_t.default
special_chebyshev_polynomial_t.n_scalar special_chebyshev_polynomial_t.x_scalar
special_chebyshev_polynomial_u.default special_chebyshev_polynomial_u.n_scalar
special_chebyshev_polynomial_u.x_scalar special_chebyshev_polynomial_v.default
special_chebyshev_polynomial_v.n_scalar special_chebyshev_polynomial_v.x_scalar
special_chebyshev_polynomial_w.default special_chebyshev_polynomial_w.n_scalar
special_chebyshev_polynomial_w.x_scalar special_entr.default special_hermite_polynomial_h.default
special_hermite_polynomial_h.n_scalar special_hermite_polynomial_h.x_scalar
special_hermite_polynomial_he.default special_hermite_polynomial_he.n_scalar
special_hermite_polynomial_he.x_scalar special_i0e.default special_i1.default special_i1e.default
special_laguerre_polynomial_l.default special_laguerre_polynomial_l.n_scalar
special_laguerre_polynomial_l.x_scalar special_legendre_polynomial_p.default
special_legendre_polynomial_p.n_scalar special_legendre_polynomial_p.x_scalar
special_log_ndtr.default special_modified_bessel_i0.default special_ndtri.default
special_shifted_chebyshev_polynomial_t.default special_shifted_chebyshev_polynomial_t.n_scalar
special_shifted_chebyshev_polynomial_t.x_scalar special_shifted_chebyshev_polynomial_u.default
special_shifted_chebyshev_polynomial_u.n_scalar special_shifted_chebyshev_polynomial_u.x_scalar
special_shifted_chebyshev_polynomial_v.default special_shifted_chebyshev_polynomial_v.n_scalar
special_shifted_chebyshev_polynomial_v.x_scalar special_shifted_chebyshev_polynomial_w.default
special_shifted_chebyshev_polynomial_w.n_scalar special_shifted_chebyshev_polynomial_w.x_scalar
special_spherical_bessel_j0.default special_xlog1py.self_scalar special_zeta.default
special_zeta.other_scalar special_zeta.self_scalar true_divide.Tensor
_neg_view.default resolve_conj.default resolve_neg.default complex.default polar.default
isreal.default logaddexp.default logaddexp2.default hardshrink.default _conj_physical.default
alias_copy.default gcd_.default lcm_.default true_divide_.Tensor special_erfcx.default
special_modified_bessel_i1.default special_modified_bessel_k0.default special_modified_bessel_k1.default
special_scaled_modified_bessel_k0.default special_scaled_modified_bessel_k1.default
special_xlog1py.default special_xlog1py.other_scalar contiguous.default""".split()

# base name -> argument positions that may be Partial together (linear ops only)
PATTERNS: dict[str, tuple[tuple[int, ...], ...]] = {
    "add": ((0, 1),), "sub": ((0, 1),), "copy": ((0, 1),), "lerp": ((0, 1),),
    "mul": ((0,), (1,)), "div": ((0,),),
    "addcmul": ((0, 1), (0, 2)), "addcdiv": ((0, 1),),
    "where": ((1, 2),),
    "neg": ((0,),), "positive": ((0,),), "clone": ((0,),), "detach": ((0,),), "alias": ((0,),),
    "lift_fresh": ((0,),), "_to_copy": ((0,),), "zero": ((0,),), "native_dropout_backward": ((0,),),
    # conj(x_P) = conj(x)_P; complex(a_P, b_P) = complex(a, b)_P
    "_conj": ((0,),), "conj_physical": ((0,),), "_conj_physical": ((0,),), "_neg_view": ((0,),), "complex": ((0, 1),),
    "true_divide": ((0,),),
}
# ops that only move or copy values: any Partial passes (they commute with max, norms, ...)
MOVES = {"clone", "detach", "alias", "lift_fresh", "_to_copy", "positive", "resolve_conj", "resolve_neg",
         "alias_copy", "contiguous"}
# overloads whose second operand is a Python scalar added to every rank's local: not linear
_SCALAR_ADD = {"Scalar"}


def pointwise_ops() -> list:
    ops = []
    for name in UNARY + BINARY:
        for variant in (name, name + "_"):
            packet = getattr(aten, variant, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                if "out" in overload or overload.endswith("_out"):
                    continue
                ops.append(getattr(packet, overload))
    for name in OVERLOADS:
        packet, overload = name.rsplit(".", 1)
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:  # an older torch may lack a special function
            ops.append(op)
    return ops


def patterns_for(call: OpCall) -> list[tuple[int, ...]]:
    """The Partial patterns of this call, as indices into call.specs."""
    return patterns(base_name(call.op), call.op._overloadname, _spec_index(call.args), call.args)


def patterns(name: str, overload: str, spec_index: dict[int, int], args=()) -> list[tuple[int, ...]]:
    """Patterns of op family `name`, given which argument positions hold DTensors
    (position -> spec index)."""
    pats = PATTERNS.get(name, ())
    if overload.endswith("_mode"):
        return []  # div with rounding (floor, trunc) is not linear
    if name == "masked_fill" and overload == "Scalar" and len(args) > 2 and args[2] == 0:
        pats = ((0,),)  # filling with zeros is linear (backward formulas do it to grads)
    if overload in _SCALAR_ADD or overload == "ScalarList":
        if name in ("add", "sub"):
            return []
        if name in ("mul", "div"):
            pats = ((0,),)
    out = []
    for pat in pats:
        if all(pos in spec_index for pos in pat):
            out.append(tuple(spec_index[pos] for pos in pat))
    return out


def base_name(op) -> str:
    """`add` for add, add_ and add.out: the op family, in-place or not."""
    name = op._overloadpacket.__name__
    return name[:-1] if name.endswith("_") else name


def _spec_index(args: Sequence) -> dict[int, int]:
    """Argument position -> index into the flat spec list, for single-DTensor args."""
    index, k = {}, 0
    for pos, a in enumerate(args):
        if isinstance(a, DTensorSpec):
            index[pos] = k
            k += 1
        elif isinstance(a, (list, tuple)):
            k += sum(isinstance(e, DTensorSpec) for e in a)
    return index


def strategies(specs: Sequence[DTensorSpec], out_shape: Sequence[int], patterns: Sequence[tuple[int, ...]],
               n_out: int = 1, moves: bool = False) -> list:
    """Pointwise strategies for one mesh axis (see the module note)."""
    R = Replicate()
    options = [((R,) * len(specs), (R,) * n_out)]
    nd = len(out_shape)
    for d in range(nd):
        ins = []
        for s in specs:
            di = d - (nd - s.ndim)
            ins.append(Shard(di) if di >= 0 and s.shape[di] == out_shape[d] else R)
        options.append((tuple(ins), (Shard(d),) * n_out))
    for d, sf in _strided_dims(specs, nd):  # FSDP over TP's layout passes through unchanged
        ins = []
        for s in specs:
            di = d - (nd - s.ndim)
            ins.append(_StridedShard(di, split_factor=sf) if di >= 0 and s.shape[di] == out_shape[d] else R)
        options.append((tuple(ins), (_StridedShard(d, split_factor=sf),) * n_out))
    kinds = partials(specs) if moves else [Partial(op) for op in partial_ops(specs)]
    for p in kinds:
        for pat in patterns:
            options.append((tuple(p if k in pat else R for k in range(len(specs))), (p,) * n_out))
    return options


def _strided_dims(specs: Sequence[DTensorSpec], nd: int) -> list[tuple[int, int]]:
    """(output dim, split factor) of every _StridedShard among the inputs, once each."""
    seen = []
    for s in specs:
        for p in s.placements:
            if type(p) is _StridedShard and (p.dim + nd - s.ndim, p.split_factor) not in seen:
                seen.append((p.dim + nd - s.ndim, p.split_factor))
    return seen


def pointwise_rule(call: OpCall) -> Sharding:
    outs = [o for o in call.outs or () if o is not None]
    moves = base_name(call.op) in MOVES
    # no meta outputs: the op refused meta tensors (e.g. lerp_ of a float32 self with a
    # bfloat16 end); for an in-place op plan on self's shape so that the local op raises
    # torch's own error, with nothing sent
    shape = tuple(outs[0].shape) if outs else tuple(call.specs[0].shape)
    n_out = len(call.outs) if call.outs is not None else 1
    return call.choose(strategies(call.specs, shape, patterns_for(call), n_out, moves))


register(*pointwise_ops())(pointwise_rule)
# masked_fill's rule reads its value (a zero fill is linear); no other pointwise rule does
FLOAT_VALUE_FREE.update(id(op) for op in pointwise_ops() if base_name(op) != "masked_fill")


__all__ = ["PATTERNS", "base_name", "patterns", "pointwise_ops", "pointwise_rule", "strategies"]
