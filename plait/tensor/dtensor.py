"""DTensor: a torch.Tensor subclass whose value is spread over a DeviceMesh.

    DTensor = wrapper (global shape/stride/dtype, what autograd and users see)
              + _local_tensor (this rank's piece, a plain tensor that never requires grad)
              + _spec (mesh, one placement per mesh axis, global shape/stride/dtype)

Autograd runs on the wrapper: every forward and backward op reaches `__torch_dispatch__`
(plait.tensor.dispatch), which inserts the collectives. from_local, to_local and
redistribute are autograd Functions (conversions.py) whose backward is the reverse move.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types

from plait.device_mesh import DeviceMesh
from plait.tensor import redistribute as redist
from plait.tensor.placement import Partial, Placement, Replicate, like_strides, normalize
from plait.tensor.spec import DTensorSpec, same_mesh

_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


class DTensor(torch.Tensor):
    """A distributed tensor: torch's `DTensor`, by name and meaning."""

    _local: torch.Tensor
    _pending: redist.Pending | None
    _spec: DTensorSpec
    _aliased = False  # a view of another DTensor (see dispatch._move_in_place)

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops go straight to dispatch

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
        if local_tensor.requires_grad and not requires_grad:
            raise ValueError("the local tensor requires grad but the DTensor would not; use from_local")
        r = _make_wrapper(cls, spec.shape, spec.stride, None, None, spec.dtype, _STRIDED,
                          local_tensor.device, False, requires_grad)
        r._local, r._pending, r._spec = local_tensor, None, spec
        if local_tensor.is_conj() or local_tensor.is_neg():
            _carry_math_bits(r, local_tensor)
        return r

    # __torch_dispatch__ is plait.tensor.dispatch.torch_dispatch, set on the class when that
    # module loads (imported at the end of this one): one Python frame per op, not two

    # -- what the user sees -----------------------------------------------------------------

    @property
    def _local_tensor(self) -> torch.Tensor:
        if self._pending is not None:
            self._local, self._pending = self._pending.wait(), None
        return self._local

    @_local_tensor.setter
    def _local_tensor(self, local: torch.Tensor) -> None:  # torch.compile swaps inner tensors
        self._local, self._pending = local, None

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: ARG002 - torch's signature
        return (f"DTensor(local_tensor={self._local_tensor}, device_mesh={self._spec.mesh}, "
                f"placements={self._spec.placements})")

    @staticmethod
    @torch._disable_dynamo  # see "torch.compile" below
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        run_check: bool = False,
        shape: torch.Size | Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        grad_placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Wrap each rank's `local_tensor` as its piece of a DTensor (no communication
        unless `run_check`). Without `shape`, shards are taken to be even; with
        `run_check=True` the ranks' sizes are gathered instead (uneven shards work), checked
        against torch.chunk's split, and Replicate axes get coordinate 0's data."""
        from plait.tensor import checks

        if isinstance(local_tensor, DTensor):
            raise TypeError("from_local takes a torch.Tensor, got a DTensor; use redistribute")
        if device_mesh is None:
            from plait.device_mesh import _current_mesh

            device_mesh = _current_mesh()  # torch's: the innermost `with mesh:` block's
        if local_tensor.device.type != device_mesh.device_type and not local_tensor.is_meta:
            local_tensor = local_tensor.to(device_mesh.device_type)
        ndim = local_tensor.dim()
        placements = normalize(placements or [Replicate()] * device_mesh.ndim, ndim, device_mesh.ndim)
        if shape is None and stride is not None:
            raise ValueError("from_local got a stride without a shape; pass the global shape too")
        if run_check and device_mesh._coordinate is not None:
            checks.check_meta(local_tensor, device_mesh, stride=shape is None)
        if shape is None:
            gathered = run_check and device_mesh._coordinate is not None
            shape = (checks.gathered_global_shape if gathered else checks.even_global_shape)(
                local_tensor, device_mesh, placements)
        shape = tuple(int(s) for s in shape)
        if stride is None:
            stride = like_strides(shape, local_tensor.stride())
        if device_mesh._coordinate is None:  # outside the mesh: an empty piece, no check (torch's)
            local_tensor = local_tensor.new_empty(0, requires_grad=local_tensor.requires_grad)
        elif run_check:
            local_tensor = checks.check_and_sync(local_tensor, device_mesh, placements, shape)
        spec = DTensorSpec(device_mesh, placements, shape, tuple(stride), local_tensor.dtype)
        if local_tensor.requires_grad and torch.is_grad_enabled():
            grads = None if grad_placements is None else normalize(grad_placements, ndim, device_mesh.ndim)
            return _conv.FromLocal.apply(local_tensor, spec, grads)
        return DTensor(local_tensor.detach(), spec, requires_grad=False)

    @torch._disable_dynamo
    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's piece as a plain tensor; differentiable (the gradient flows back as a
        DTensor with these placements, or `grad_placements`)."""
        if not (self.requires_grad and torch.is_grad_enabled()):
            return self._local_tensor
        if grad_placements is not None:
            grad_placements = normalize(grad_placements, self.ndim, self._spec.mesh.ndim)
        return _conv.ToLocal.apply(self, grad_placements)

    @torch._disable_dynamo
    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """The same global value with new placements on the same mesh; differentiable
        (backward is the reverse move, Partial becoming Replicate)."""
        spec = self._spec
        if device_mesh is not None and not same_mesh(device_mesh, spec.mesh):
            raise ValueError(f"redistribute moves between placements on one mesh; this DTensor is on "
                             f"{spec.mesh}, not {device_mesh}")
        if placements is None:
            placements = [Replicate()] * spec.mesh.ndim
        placements = normalize(placements, self.ndim, spec.mesh.ndim)
        return _conv.Redistribute.apply(self, placements, async_op, forward_dtype, backward_dtype)

    @torch._disable_dynamo
    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global value on every rank, as a plain tensor (differentiable)."""
        replicated = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    # -- torch.compile ------------------------------------------------------------------------
    # Dynamo traces through ops on DTensors (AOTAutograd flattens them to their local tensors
    # and runs dispatch on fake ones). It cannot trace the construction of a new wrapper in
    # Python, so from_local / to_local / redistribute / full_tensor are run eagerly: a graph
    # break at each call, instead of a failed trace. TODO(compile): teach Dynamo these, as
    # torch does for its own DTensor, to trace tensor-parallel hooks without breaks.

    def __tensor_flatten__(self):
        return ["_local_tensor"], _FlatMeta(self._spec.mesh, self._spec.placements, self.requires_grad)

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd's cache key for a DTensor input: everything a compiled graph depends on
        (global and local metadata, placements, the mesh's ranks and process groups, whose
        names the graph's collectives carry). Without it, torch pickles the flatten
        metadata, fails on the mesh's process groups, and warns at every compile."""
        spec, local = self._spec, self._local_tensor
        mesh = spec.mesh
        groups = tuple(mesh.get_group(axis).group_name for axis in range(mesh.ndim))
        key = (type(self).__qualname__, tuple(self.shape), tuple(self.stride()), str(self.dtype),
               self.requires_grad, repr(spec.placements), tuple(mesh.shape), mesh.mesh_dim_names,
               tuple(mesh.mesh.flatten().tolist()), groups, tuple(local.shape), tuple(local.stride()),
               str(local.dtype), str(local.device))
        return hashlib.sha256(repr(key).encode()).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        local = inner_tensors["_local_tensor"]
        spec = DTensorSpec(flatten_spec.mesh, flatten_spec.placements, tuple(outer_size),
                           tuple(outer_stride), local.dtype)
        return DTensor(local, spec, requires_grad=flatten_spec.requires_grad)

    def __coerce_tangent_metadata__(self):
        if not self._spec.has_partial():
            return self
        return self.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                             for p in self._spec.placements])

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        if expected_type is not None:
            return None
        return self.redistribute(placements=flatten_spec.placements)


class _FlatMeta:
    """What __tensor_flatten__ records besides the local tensor. torch.compile compares it
    to guard a graph and deep-copies it; the mesh (process groups) is shared, not copied.
    Shape and stride are not in it: they travel as the wrapper's own."""

    __slots__ = ("mesh", "placements", "requires_grad")

    def __init__(self, mesh: DeviceMesh, placements: tuple[Placement, ...], requires_grad: bool) -> None:
        self.mesh, self.placements, self.requires_grad = mesh, placements, requires_grad

    def _key(self) -> tuple:
        return (self.mesh, self.placements, self.requires_grad)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FlatMeta) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __deepcopy__(self, memo: dict) -> _FlatMeta:
        return self

    def __reduce__(self) -> tuple:
        # torch's AOTAutograd cache pickles compiled graphs with this metadata: the mesh goes
        # by its ranks and names (its process groups cannot be pickled) and comes back as an
        # equal mesh over the same groups (new_group returns the one this process made)
        m = self.mesh
        return (_restore_flat_meta, (m.device_type, m.mesh.tolist(), m.mesh_dim_names, self.placements,
                                     self.requires_grad))

    def __repr__(self) -> str:
        return f"DTensorMeta({list(self.placements)}, requires_grad={self.requires_grad})"


def _restore_flat_meta(device_type: str, ranks: list, names: tuple[str, ...] | None,
                       placements: tuple[Placement, ...], requires_grad: bool) -> _FlatMeta:
    return _FlatMeta(DeviceMesh(device_type, ranks, mesh_dim_names=names), placements, requires_grad)


def wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor over `local` (dispatch's fast path: no checks, no grad)."""
    # positional: (size, strides, storage_offset, memory_format, dtype, layout, device,
    # pin_memory, requires_grad) parse faster than keywords, on every op's output
    r = _make_wrapper(DTensor, spec.shape, spec.stride, None, None, spec.dtype, _STRIDED,
                      local.device, False, False)
    r._local, r._pending, r._spec = local, None, spec
    if local.is_conj() or local.is_neg():
        _carry_math_bits(r, local)
    return r


def _carry_math_bits(r: DTensor, local: torch.Tensor) -> None:
    """Give the wrapper its local's lazy conjugate and negative bits, as torch's DTensor does.

    Inside __torch_dispatch__ the Conjugate and Negative dispatch keys are excluded, so a
    local op would read a conj-bit local's raw values (`g * f.conj()` computed `g * f`).
    With the bit on the wrapper, torch's own math-bit fallback resolves it at the wrapper,
    before dispatch, for every op that is not conj-aware (a clone of the DTensor, which
    copy_ materialises), and conj-aware ops (views, mm) see the bit on both, as in eager."""
    if local.is_conj():
        torch._C._set_conj(r, True)
    if local.is_neg():
        torch._C._set_neg(r, True)


_NO_KWARGS: dict = {}

# As torch's DTensor does (torch/distributed/tensor/__init__.py): an optimizer left at
# foreach=None takes DTensor parameters as foreach-capable, so on an accelerator it runs one
# _foreach_* op per step over all of them (a dispatch each) instead of one op per parameter
# (AdamW: 8 dispatches per parameter). No effect on CPU, where torch's default is the loop.
# A group mixing DTensor and plain parameters is split per index (dispatch._foreach_by_kind).
# (torch also adds DTensor to torch.utils._foreach_utils' list, which turns clip_grad_norm_'s
# default to foreach on CPU too; not done here.)
if DTensor not in _optim_foreach_types:
    _optim_foreach_types.append(DTensor)

# these import this module; binding the modules (not their names) lets either load first
from plait.tensor import conversions as _conv  # noqa: E402
from plait.tensor import dispatch as _dispatch  # noqa: E402, F401 - binds __torch_dispatch__

__all__ = ["DTensor", "wrap"]
