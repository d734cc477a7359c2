"""DeviceMesh: global ranks laid out on an N-D grid with a named axis per dimension.

    init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        -> root mesh: for each axis, one process group for the slice through this rank
    mesh["tp"], mesh["dp", "tp"]           -> sub-meshes: views of the root, same groups
    mesh["dp", "tp"].flatten("dp_tp")      -> one axis over several; mesh["dp_tp"] after
    world._unflatten(0, (2, 4), ("dp", "tp"))  -> one axis split in several: a new root mesh

Every mesh is a view of its root: each of its axes is a tuple of root axes (one, or
several for a flattened axis). Groups come from `plait.comm.new_group`, which creates a
group per rank set once per process; building, slicing and flattening meshes never makes
a second group for the same ranks. All ranks construct the same meshes in the same order
(SPMD); only a slice's members create its group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from plait import comm

Axis = tuple[int, ...]  # root axes that one mesh axis spans, in increasing order
# the meshes of the `with mesh:` blocks this thread is in, innermost last (torch's
# _mesh_resources.mesh_stack): distribute_tensor, from_local, ... default to the innermost
_mesh_stack: list[DeviceMesh] = []


def _current_mesh() -> DeviceMesh:
    """The mesh of the innermost `with mesh:` block (torch's get_current_mesh)."""
    if not _mesh_stack:
        raise RuntimeError("No device mesh is currently active! Pass device_mesh=, or run inside "
                           "`with mesh:`")
    return _mesh_stack[-1]


class DeviceMesh:
    """An N-D mesh of global ranks, torch's `DeviceMesh` by name and meaning.

    `mesh` is an int tensor (or nested list) of global ranks; every rank of the job
    constructs the same mesh. A rank outside it gets `get_coordinate() is None`, makes no
    group, and holds empty local tensors for the mesh's DTensors (as in torch).
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _root: DeviceMesh | None = None,
        _axes: Sequence[Axis] | None = None,
        _groups: Sequence[ProcessGroup] | None = None,
    ) -> None:
        mesh = torch.as_tensor(mesh, dtype=torch.int64, device="cpu").detach().clone()
        if mesh.dim() == 0:
            raise ValueError("mesh must have at least one dimension")
        self.device_type = device_type
        self.mesh = mesh
        self.mesh_dim_names = _check_names(mesh_dim_names, mesh.dim())
        self._root = _root or self
        self._axes: tuple[Axis, ...] = tuple(_axes) if _axes is not None else tuple((i,) for i in range(mesh.dim()))
        if _root is None:
            self._flattened: dict[str, Axis] = {}
            _check_ranks(mesh)
        me = comm.global_rank()
        where = (mesh == me).nonzero()
        self._coordinate = tuple(int(i) for i in where[0]) if len(where) else None
        self._key()
        if self._coordinate is None:
            self._groups: tuple[ProcessGroup | None, ...] = (None,) * mesh.dim()
        elif _groups is not None:
            self._groups = tuple(_groups)
        else:
            self._groups = tuple(comm.new_group(self._slice_ranks(i)) for i in range(mesh.dim()))

    # -- structure -------------------------------------------------------------------------

    def _slice_ranks(self, axis: int) -> list[int]:
        """Ranks along `axis` through this rank, in coordinate order (checked increasing)."""
        index = list(self._coordinate)
        index[axis] = slice(None)
        ranks = self.mesh[tuple(index)].tolist()
        if ranks != sorted(ranks):
            raise ValueError(
                f"mesh axis {self._axis_label(axis)} slice {ranks} is not in increasing global-rank "
                "order; a group's ranks are ordered by global rank, so list each axis's ranks in "
                "increasing order"
            )
        return ranks

    def _axis_label(self, axis: int) -> str:
        return repr(self.mesh_dim_names[axis]) if self.mesh_dim_names else str(axis)

    def _axis_index(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.mesh.dim() != 1:
                raise ValueError(f"this mesh has {self.mesh.dim()} axes {self.mesh_dim_names}; name one")
            return 0
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no axis {mesh_dim!r}; its axes are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.mesh.dim() <= mesh_dim < self.mesh.dim():
            raise IndexError(f"mesh axis {mesh_dim} is out of range for a {self.mesh.dim()}-D mesh")
        return mesh_dim % self.mesh.dim()

    @property
    def ndim(self) -> int:
        return self.mesh.dim()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Ranks along `mesh_dim`, or in the whole mesh when None."""
        return self.mesh.numel() if mesh_dim is None else self.mesh.size(self._axis_index(mesh_dim))

    def get_rank(self) -> int:
        """This process's global rank."""
        return comm.global_rank()

    def _is_current_rank_part_of_mesh(self) -> bool:
        """Whether this rank is in the mesh. A rank outside it (torch's non-participating
        rank) holds empty local tensors for the mesh's DTensors and takes part in nothing."""
        return self._coordinate is not None

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along every axis, or None if it is not in the mesh."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along `mesh_dim` (= its rank in that axis's group)."""
        axis = self._axis_index(mesh_dim)
        if self._coordinate is None:
            raise ValueError(f"global rank {comm.global_rank()} is not in this mesh")
        return self._coordinate[axis]

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The process group of `mesh_dim`'s slice through this rank."""
        group = self._groups[self._axis_index(mesh_dim)]
        if group is None:
            raise ValueError(f"global rank {comm.global_rank()} is not in this mesh and has no group")
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(i) for i in range(self.ndim)]

    # -- slicing and flattening ----------------------------------------------------------

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over the named axes (or flattened axes), through this rank."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names:
            raise ValueError("name at least one mesh axis")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names {names} repeat")
        root = self._root
        axes: list[Axis] = []
        for name in names:
            if self.mesh_dim_names and name in self.mesh_dim_names:
                axes.append(self._axes[self.mesh_dim_names.index(name)])
            elif name in root._flattened:
                axes.append(root._flattened[name])
            else:
                known = list(self.mesh_dim_names or ()) + list(root._flattened)
                raise KeyError(f"mesh has no axis {name!r}; its axes are {known}")
        flat = [a for axis in axes for a in axis]
        if flat != sorted(flat) or len(set(flat)) != len(flat):
            raise ValueError(
                f"axes {names} must be named in the mesh's order and must not overlap "
                f"(root axes {[list(a) for a in axes]})"
            )
        if names == self.mesh_dim_names:
            return self
        return root._view(axes, names, self.device_type)

    def _view(self, axes: Sequence[Axis], names: Sequence[str], device_type: str) -> DeviceMesh:
        """A sub-mesh of this root over `axes`, fixed at this rank's coordinate elsewhere."""
        assert self._root is self, "views are taken of the root mesh"
        if self._coordinate is None:
            raise ValueError(f"global rank {comm.global_rank()} is not in this mesh; it cannot slice it")
        used = {a for axis in axes for a in axis}
        index = tuple(slice(None) if a in used else c for a, c in enumerate(self._coordinate))
        sub = self.mesh[index]  # the used root axes, in increasing order
        sub = sub.reshape([math.prod(self.mesh.size(a) for a in axis) for axis in axes])
        return DeviceMesh(device_type, sub, mesh_dim_names=names, _root=self, _axes=axes)

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """One axis spanning all of this mesh's axes; afterwards `root[mesh_dim_name]`
        returns it too. Default name: the axis names joined by "_"."""
        name = mesh_dim_name or "_".join(self.mesh_dim_names or ())
        if not name:
            raise ValueError("an unnamed mesh's flattened axis needs a mesh_dim_name")
        axis: Axis = tuple(a for spec in self._axes for a in spec)
        root = self._root
        taken = root._flattened.get(name)
        if (root.mesh_dim_names and name in root.mesh_dim_names) or (taken is not None and taken != axis):
            raise ValueError(f"mesh axis name {name!r} is already used; pick another for the flattened axis")
        root._flattened[name] = axis
        return root._view([axis], (name,), self.device_type)

    _flatten = flatten  # torch's spelling

    def _unflatten(self, dim: int | str, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override: dict | None = None) -> DeviceMesh:
        """torch's: axis `dim` split row-major into axes of `mesh_sizes` named `mesh_dim_names`,
        the other axes kept (world (8,) -> ("dp", "cp", "tp") (2, 2, 2): mesh.view(2, 2, 2)).

        The result is a root of its own: torchtitan unflattens one world mesh several times,
        with overlapping names ("pp", "batch", ...; "pp", "fsdp", ...), and slices and flattens
        each by its own names. Its groups are the ones any mesh over the same ranks uses
        (comm.new_group creates one per rank set). `backend_override` (name or index -> backend):
        torchtitan's "fake" on an axis of size 1 is taken as given (a 1-rank group is what a
        fake one stands for); an axis of more ranks keeps the job's backend."""
        names = self.mesh_dim_names
        if names is None:
            raise ValueError(f"_unflatten needs a mesh with mesh_dim_names; this one is {self!r}")
        if isinstance(dim, str):
            if dim not in names:
                raise ValueError(f"dim {dim!r} specified in `_unflatten` is not in {names}")
            dim = names.index(dim)
        elif not -self.ndim <= dim < self.ndim:
            raise ValueError(f"dim {dim} specified in `_unflatten` is out of range {self.ndim}")
        dim %= self.ndim
        sizes, new_names = tuple(int(s) for s in mesh_sizes), tuple(mesh_dim_names)
        if len(sizes) != len(new_names):
            raise RuntimeError(f"mesh_dim_names {new_names} must have same length as mesh_sizes {sizes} in _unflatten")
        if math.prod(sizes) != self.mesh.size(dim):
            raise ValueError(f"The product of mesh_sizes={sizes} is {math.prod(sizes)}, but the original "
                             f"dimension at dim={dim} ({names[dim]!r}) has size {self.mesh.size(dim)}. These "
                             "must be equal for unflatten to work correctly.")
        _check_backend_override(backend_override or {}, sizes, new_names)
        shape = [*self.mesh.shape[:dim], *sizes, *self.mesh.shape[dim + 1:]]
        return DeviceMesh(self.device_type, self.mesh.reshape(shape),
                          mesh_dim_names=(*names[:dim], *new_names, *names[dim + 1:]))

    @staticmethod
    def from_group(group: ProcessGroup, device_type: str, *, mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
        """A 1-D mesh over an existing group's ranks, using that group."""
        ranks = list(comm.group_info(group).ranks)
        return DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _groups=[group])

    # -- pickling (torch.save of a DTensor) ------------------------------------------------

    def __getstate__(self) -> dict:
        # process groups do not pickle; a loaded mesh looks its groups up again by their
        # ranks (comm.new_group returns the group this process already made), as torch's
        # DeviceMesh does by group name
        state = dict(self.__dict__)
        state["_groups"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._coordinate is None:
            self._groups = (None,) * self.mesh.dim()
        else:
            self._groups = tuple(comm.new_group(self._slice_ranks(i)) for i in range(self.mesh.dim()))

    # -- the current mesh (torch's context manager) -----------------------------------------

    def __enter__(self) -> DeviceMesh:
        _mesh_stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert _mesh_stack and _mesh_stack[-1] is self, "`with mesh:` blocks must nest"
        _mesh_stack.pop()

    # -- identity ----------------------------------------------------------------------

    def _key(self) -> tuple:
        # computed once: hashing a mesh must not run tensor ops (DTensor hashes its mesh on
        # every dispatch, and under torch.compile's fake mode a real-tensor op raises)
        key = self.__dict__.get("_key_cache")
        if key is None:
            key = (self.device_type, tuple(self.mesh.shape), tuple(self.mesh.view(-1).tolist()),
                   self.mesh_dim_names)
            self._key_cache = key
        return key

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DeviceMesh) and self._key() == other._key())

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"


def _check_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim:
        raise ValueError(f"mesh_dim_names {names} has {len(names)} names for a {ndim}-D mesh")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"mesh_dim_names {names} repeat {dup}")
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"mesh_dim_names {names} must be non-empty strings")
    return names


def _check_backend_override(override: dict, sizes: tuple[int, ...], names: tuple[str, ...]) -> None:
    """An override on an axis of more than one rank must name the job's own backend: plait's
    groups are made by comm.new_group, on the backend the job started with."""
    job = torch.distributed.get_backend()
    for key, value in override.items():
        if key in names:
            axis = names.index(key)
        elif isinstance(key, int) and 0 <= key < len(sizes):
            axis = key
        else:
            raise RuntimeError(f"Found invalid keys in backend_override: got {key!r}, expected integers in "
                               f"range [0, {len(sizes)}) or one of {names}")
        backend = value[0] if isinstance(value, tuple) else value
        if sizes[axis] > 1 and isinstance(backend, str) and backend.lower() != job:
            raise ValueError(f"backend_override {backend!r} for mesh axis {names[axis]!r} of {sizes[axis]} ranks: "
                             f"plait's groups use the job's backend {job!r}")


def _check_ranks(mesh: torch.Tensor) -> None:
    ranks = mesh.view(-1).tolist()
    world = comm.world_size()
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"mesh lists global ranks {dup} more than once")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"mesh ranks {bad} are not in [0, world_size {world})")


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A mesh of all ranks in row-major order with shape `mesh_shape`, starting the
    default process group from the launcher's environment if it is not running yet."""
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if not mesh_shape or any(s < 1 for s in mesh_shape):
        raise ValueError(f"mesh shape {mesh_shape} must have one or more positive sizes")
    _check_names(mesh_dim_names, len(mesh_shape))
    if not comm.is_initialized():
        comm.init_process_group("nccl" if device_type == "cuda" else "gloo")
    world = comm.world_size()
    if math.prod(mesh_shape) != world:
        shape = ", ".join(map(str, mesh_shape))
        raise ValueError(f"mesh shape ({shape}) = {math.prod(mesh_shape)} != world_size {world}")
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(comm.global_rank() % torch.cuda.device_count())
    mesh = torch.arange(world).view(mesh_shape)
    return DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names)


__all__ = ["DeviceMesh", "init_device_mesh"]
