"""FSDPParam: one parameter of a group, in its three forms.

    original nn.Parameter (shape S, dim d sharded)
      -> sharded: nn.Parameter(DTensor, Shard(d)), registered on the module while SHARDED;
         its local tensor (torch.chunk piece r along d) is the only parameter memory held
         between steps, and the optimizer steps on it
      -> padded shard: the local piece with d moved first, flattened and zero-padded to
         ceil(S[d]/N) rows, copied into the group's all-gather input at its offset
      -> unsharded: a plain nn.Parameter (an autograd leaf) whose data is a view into the
         group's flat unsharded buffer, registered on the module while UNSHARDED

In "rows" layout (d moved first) rank r's padded shard holds rows [r*P, (r+1)*P), P the
padded row count. torch.chunk fills ranks in order, so the real rows are exactly the first
S[d] rows of the N*P padded rows: the unsharded view is a prefix, the padding never shows.
The gradient goes the other way: the unsharded .grad, in rows layout, fills the same prefix
of the reduce-scatter input (padding zero), and rank r's reduced piece lands in the
sharded .grad as a DTensor with the parameter's spec.

Over tensor parallel (the original parameter is a DTensor on mesh["tp"], FSDP's mesh is
mesh["dp"] of the same root mesh), everything above runs on the TP-local tensor: S is its
shape, the all-gather over dp rebuilds it, the unsharded parameter is a DTensor on
mesh["tp"] with TP's spec (what the TP styles expect), and its gradient is first moved to
TP's placements (a Partial gradient of a Replicate weight under sequence parallel is
all-reduced over tp, as torch's FSDP does) before its local tensor is reduce-scattered over
dp. The sharded parameter is a DTensor on the (dp, tp) mesh (HSDP: (dp_replicate, dp_shard,
tp)) with torch's placements: (Shard(d), TP's) where TP leaves d whole, and
(_StridedShard(d, sf=tp), Shard(d)) where TP shards d too, since the dp piece is then cut
from the TP piece (dp_tp_layout); either way it is one block of the global tensor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.device_mesh import DeviceMesh
from plait.tensor import DTensor, Replicate, Shard, _StridedShard
from plait.tensor.placement import Placement, chunk_offset, contiguous_strides
from plait.tensor.spec import DTensorSpec


class FSDPParam:
    """One parameter of a group; `sites` are the (module, name) slots it is registered in
    (several for a weight tied within the group)."""

    def __init__(
        self,
        param: nn.Parameter,
        sites: list[tuple[nn.Module, str]],
        mesh: DeviceMesh,
        placement: Shard,
        *,
        shard_device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.sites = sites
        self.fqn = sites[0][1]  # the full dotted name is set when the root initialises
        self.shape = tuple(param.shape)  # global (over TP too)
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        source = param._local_tensor if isinstance(param, DTensor) else param  # TP-local
        shape = tuple(source.shape)
        self.orig_dtype = param.dtype
        self.requires_grad = param.requires_grad
        self.dim = placement.dim % max(param.dim(), 1)
        n, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
        self.world = n
        self.rows = shape[self.dim]
        self.rest = shape[: self.dim] + shape[self.dim + 1:]  # the other dims, in order
        self.row_numel = math.prod(self.rest)
        self.numel = self.rows * self.row_numel
        self.pad_rows = -(-self.rows // n)
        self.padded_numel = self.pad_rows * self.row_numel  # per rank, in the flat buffers
        self.local_rows, start = chunk_offset(self.rows, n, rank)
        self.local_numel = self.local_rows * self.row_numel
        # a plain parameter sharded on dim 0: the group's loops move it inline (no call per
        # parameter per step); any other runs through copy_in / pop_grad_rows / take_shard_grad
        self.rows_first = self.dim == 0 and not isinstance(param, DTensor)
        # (full, rem): the unsharded rows fill `full` rows of its (world, padded_numel) block
        # of the reduce-scatter input, and `rem` elements of the next
        self.grad_split = divmod(self.numel, self.padded_numel) if self.padded_numel else (0, 0)

        local = source.detach().narrow(self.dim, start, self.local_rows)
        if not local.is_meta and local.device != shard_device:
            local = local.to(shard_device)
        local = local.contiguous().clone() if not local.is_meta else torch.empty_like(local.contiguous())
        if pin_memory and local.device.type == "cpu" and torch.accelerator.is_available():
            local = local.pin_memory()
        if self.tp_spec is not None:
            spec_mesh, placements = dp_tp_layout(mesh, self.tp_spec, self.dim)
        else:
            spec_mesh = mesh
            placements = (Shard(self.dim),) if mesh.ndim == 1 else (Replicate(), Shard(self.dim))
        spec = DTensorSpec(spec_mesh, placements, self.shape, contiguous_strides(self.shape), param.dtype)
        self.sharded = nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=param.requires_grad)
        self.unsharded: nn.Parameter | None = None  # created at the first unshard, kept after
        self.acc_grad: torch.Tensor | None = None  # unsharded grads kept in reduce_dtype across no-sync steps
        self.in_flat = False  # FSDP1's use_orig_params=False: the local is a view of the group's flat parameter

    # -- the sharded form ------------------------------------------------------------------

    def refresh_sharded(self) -> None:
        """Adopt a parameter the user registered in our place (load_state_dict(assign=True),
        module._apply), after checking it is a DTensor laid out as ours is."""
        module, name = self.sites[0]
        current = module._parameters.get(name)
        if current is self.sharded or current is self.unsharded or current is None:
            return
        if not isinstance(current, DTensor) or current._spec.placements != self.sharded._spec.placements \
                or tuple(current.shape) != self.shape:
            raise ValueError(
                f"parameter {self.fqn!r} was replaced by a {type(current).__name__} of shape "
                f"{tuple(current.shape)}; fully_shard needs a DTensor of shape {self.shape} with placements "
                f"{self.sharded._spec.placements} (load a sharded state dict, or call load_state_dict "
                "without assign=True)"
            )
        if self.in_flat:  # the values go into the flat parameter's view; the parameter stays ours
            with torch.no_grad():
                self.local.copy_(current._local_tensor)
            self.register(self.sharded)
            return
        if not isinstance(current, nn.Parameter):
            current = nn.Parameter(current, requires_grad=self.requires_grad)
        self.sharded = current
        for m, n in self.sites:
            m._parameters[n] = current

    @property
    def local(self) -> torch.Tensor:
        return self.sharded._local_tensor

    def register_resting(self) -> None:
        """Register the form held between steps: the sharded parameter, or nothing when the
        flat parameter stands for it (FSDP1's use_orig_params=False)."""
        self.register(None if self.in_flat else self.sharded)

    def register(self, which: nn.Parameter | None) -> None:
        for module, name in self.sites:
            module._parameters[name] = which

    def copy_in(self, dst: torch.Tensor) -> None:
        """Write this rank's padded shard into `dst` (padded_numel,), casting to dst's dtype."""
        n = self.local_rows * self.row_numel
        rows = self.local if self.dim == 0 else self.local.movedim(self.dim, 0)
        dst[:n].copy_(rows.reshape(-1))
        dst[n:].zero_()

    # -- the unsharded form ----------------------------------------------------------------

    def bind(self, block: torch.Tensor) -> None:
        """Point the unsharded parameter at `block` (world * padded_numel,) of the flat
        buffer, once: later unshards refill the same storage, so the autograd graph's saved
        references to the parameter see the new values."""
        view = block[: self.numel].view(self.rows, *self.rest)  # (rows, *rest)
        if self.dim != 0:
            view = view.movedim(0, self.dim)  # back to the parameter's shape, strided
        if self.tp_spec is not None:
            # a DTensor leaf on mesh["tp"]; autograd saves the wrapper, whose version counter
            # is its own, while its local tensor stays a view of the refilled flat buffer
            # (bind runs again only for a new buffer or dtype, so a new leaf is right then)
            spec = DTensorSpec(self.tp_spec.mesh, self.tp_spec.placements, self.tp_spec.shape,
                               self.tp_spec.stride, view.dtype)
            self.unsharded = nn.Parameter(DTensor(view, spec, requires_grad=False),
                                          requires_grad=self.requires_grad)
            return
        if self.unsharded is None:
            # .data keeps the Parameter's own version counter: refilling the flat buffer in
            # place does not look like an in-place change of a tensor saved for backward
            self.unsharded = nn.Parameter(torch.empty(0, dtype=block.dtype, device=block.device),
                                          requires_grad=self.requires_grad)
        self.unsharded.data = view

    def full_from(self, block: torch.Tensor) -> torch.Tensor:
        """The whole parameter (TP-local), contiguous, from its column block (world,
        padded_numel) of a gathered (N, S): rank-major rows, the real ones a prefix."""
        rows = block.reshape(-1)[: self.numel].view(self.rows, *self.rest)  # one copy (the block is strided)
        return rows if self.dim == 0 else rows.movedim(0, self.dim).contiguous()

    def pop_grad_rows(self) -> torch.Tensor | None:
        """The unsharded gradient plus any accumulated one, flat in rows layout (numel,), or
        None without either; both are cleared. ParamGroup.post_backward writes it into the
        reduce-scatter input (and does this inline for a rows_first parameter)."""
        grad = self._unsharded_grad()
        if grad is None and self.acc_grad is None:
            return None
        if grad is not None:
            rows = (grad if self.dim == 0 else grad.movedim(self.dim, 0)).reshape(-1)
            if self.acc_grad is not None:
                rows = self.acc_grad + rows
        else:
            rows = self.acc_grad
        self.clear_grad()
        return rows

    def accumulate_unsharded(self, dtype: torch.dtype) -> None:
        """Keep this step's unsharded gradient (no gradient sync) in `dtype`, in rows layout."""
        grad = self._unsharded_grad()
        if grad is None or (grad.dtype == dtype and self.tp_spec is None):
            return  # autograd accumulates into .grad itself
        rows = (grad if self.dim == 0 else grad.movedim(self.dim, 0)).reshape(-1).to(dtype)
        self.acc_grad = rows if self.acc_grad is None else self.acc_grad.add_(rows)
        self.unsharded.grad = None

    def _unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded gradient as a plain tensor of the (TP-local) shape; a DTensor one
        is moved to TP's placements first (Partial -> all-reduce over tp)."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if grad is None or self.tp_spec is None:
            return grad
        if not isinstance(grad, DTensor):
            raise TypeError(f"parameter {self.fqn!r} is tensor-parallel but got a {type(grad).__name__} "
                            "gradient; expected a DTensor on its tp mesh")
        if grad._spec.placements != self.tp_spec.placements:
            with torch.no_grad():
                grad = grad.redistribute(self.tp_spec.mesh, self.tp_spec.placements)
        return grad._local_tensor

    def clear_grad(self) -> None:
        if self.unsharded is not None:
            self.unsharded.grad = None
        self.acc_grad = None

    def take_shard_grad(self, piece: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Add rank r's reduced piece (padded_numel,) to the sharded .grad, which is kept in
        `dtype` (None: the parameter's own; FSDP1's keep_low_precision_grads: param_dtype)."""
        dtype = dtype or self.orig_dtype
        local = piece[: self.local_rows * self.row_numel].view(self.local_rows, *self.rest)
        if self.dim != 0:
            local = local.movedim(0, self.dim)
        grad = self.sharded.grad
        if grad is not None and grad.dtype == dtype:
            # fully_shard casts the piece to the grad's dtype, then adds (as torch's FSDP2);
            # a low-precision grad adds the piece as it is (reduce_dtype, float32) and rounds
            # once, as torch's FSDP1 (upcast, accumulate, cast down) does
            low = dtype != self.orig_dtype
            grad._local_tensor.add_(local.to(device=self.local.device, dtype=None if low else dtype))
            return
        local = local.to(device=self.local.device, dtype=dtype)
        if grad is not None:  # kept from a step of another grad dtype: add in the wider one
            local = (grad._local_tensor.to(torch.promote_types(grad.dtype, local.dtype)) + local).to(dtype)
        elif local.untyped_storage().data_ptr() == piece.untyped_storage().data_ptr():
            local = local.clone()  # do not keep the whole reduce-scatter output alive
        spec = self.sharded._spec
        if dtype != spec.dtype:
            spec = DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, dtype)
        set_grad(self.sharded, DTensor(local.contiguous(), spec, requires_grad=False))


def set_grad(param: nn.Parameter, grad: torch.Tensor | None) -> None:
    """`param.grad = grad`, also when grad's dtype is not param's (FSDP1's
    keep_low_precision_grads: a float32 parameter with a bfloat16 .grad).

    Autograd refuses a .grad of another dtype, so a placeholder of param's dtype and shape is
    assigned (no memory: a DTensor wrapper over grad's local tensor, or an expanded scalar)
    and grad's metadata is then swapped in with .data, torch's FSDP1's way around the same
    check. Only the optimizer reads such a .grad: autograd never accumulates into a sharded
    parameter's, and the next take_shard_grad adds to it in place."""
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
        return
    if isinstance(grad, DTensor):
        spec = grad._spec
        holder = DTensor(grad._local_tensor, DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride,
                                                         param.dtype), requires_grad=False)
        param.grad = holder
        holder.data = grad  # the wrapper's dtype becomes grad's ...
        holder._spec = spec  # ... and so does the spec the dispatcher reads
        return
    param.grad = torch.empty((), dtype=param.dtype, device=grad.device).expand(grad.shape)
    param.grad.data = grad


def dp_tp_layout(dp_mesh: DeviceMesh, tp_spec: DTensorSpec, dim: int) \
        -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh over FSDP's axes and TP's (in the root's axis order) and the placements of a
    parameter TP lays out as `tp_spec` and FSDP shards on `dim` of its TP-local tensor over
    the last axis of `dp_mesh` (a first axis of a 2-D dp mesh replicates: HSDP).

    FSDP cuts the TP-local tensor, so its cut comes after TP's in the global tensor: where a
    TP axis that shards `dim` follows the dp shard axis in the mesh, the dp placement is
    torch's _StridedShard(dim, split_factor=those TP axes' size), else a plain Shard(dim)."""
    tp_mesh = tp_spec.mesh
    root = dp_mesh._root
    axes = [(dp_mesh._axes[i][0], name, "dp", i) for i, name in enumerate(dp_mesh.mesh_dim_names)]
    axes += [(tp_mesh._axes[j][0], name, "tp", j) for j, name in enumerate(tp_mesh.mesh_dim_names)]
    axes.sort()
    mesh = root[tuple(name for _, name, _, _ in axes)]
    shard_at = next(k for k, (_, _, kind, i) in enumerate(axes) if kind == "dp" and i == dp_mesh.ndim - 1)
    split = math.prod(tp_mesh.size(j) for k, (_, _, kind, j) in enumerate(axes) if kind == "tp" and k > shard_at
                      and tp_spec.placements[j] == Shard(dim))
    dp_shard = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    placements = []
    for _, _, kind, i in axes:
        if kind == "tp":
            placements.append(tp_spec.placements[i])
        else:
            placements.append(dp_shard if i == dp_mesh.ndim - 1 else Replicate())
    return mesh, tuple(placements)


__all__ = ["FSDPParam", "dp_tp_layout", "set_grad"]
