"""Process groups: start-up from the launcher's environment, and one cached group per rank set.

Every collective in plait names its group explicitly. This file turns a c10d
`ProcessGroup` into the facts the door needs (its ranks, this rank's place in it, its
backend, its sequence counter) and creates each sub-group exactly once per process:
`new_group((0, 2))` called by a device mesh, a sub-mesh and a strategy returns the same
group, so nothing grows with the number of calls (pytorch#153302).

The caches belong to one life of c10d's default group: a job (a test suite, a notebook, an
in-process elastic restart) may call `torch.distributed.destroy_process_group()` and
`init_process_group()` again, and c10d then reuses group names ("0", "1", ...) for new
groups. Each cached entry holds the group object it describes, and a lookup checks that
object is the one asked about and still in c10d's map of live groups (a pointer compare and
one dict probe, ~40 ns on a collective's path); otherwise the caches follow the default group
(emptied when it changed), and a handle from an old life (a mesh or group kept across the
re-init, or one destroyed alone) fails with `StaleGroupError` naming it, never runs on stale facts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as _c10d

from plait.comm import shutdown

_world = _c10d._world  # c10d's state; _world._default_pg is the default group's life
_live = _world.pg_map  # every live group; c10d clears and deletes from it, never rebinds it

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class GroupInfo:
    """What the door knows about one group, looked up once per group."""

    name: str
    ranks: tuple[int, ...]  # global ranks, in group-rank order
    rank: int  # this process's rank within the group
    backend: str
    # the group described: a lookup by name checks it is the same object (module docstring)
    group: ProcessGroup | None = field(default=None, repr=False, compare=False)
    seq: int = 0  # collectives issued on this group by this rank
    # p2p ops per (kind, peer): the n-th send a->b matches b's n-th recv from a, whatever
    # collectives the other members run in between
    p2p_seq: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.ranks)


_infos: dict[str, GroupInfo] = {}
_groups_by_ranks: dict[tuple[int, ...], ProcessGroup] = {}
_cached_under: ProcessGroup | None = None  # the default group the caches were filled under


class StaleGroupError(RuntimeError):
    """A group used after it (or the default group it was made under) was destroyed."""


def _follow_default_group() -> None:
    """Empty the caches if c10d's default group is not the one they were filled under."""
    global _cached_under
    if _cached_under is not _world._default_pg:
        _infos.clear()
        _groups_by_ranks.clear()
        _cached_under = _world._default_pg


def _check_alive(group: ProcessGroup) -> None:
    if group not in _live:
        name = getattr(group, "group_name", "?")
        raise StaleGroupError(
            f"process group {name!r} (size {group.size()}) was destroyed (destroy_process_group, "
            "or a new init_process_group since it was made); build meshes and groups again from "
            "the running default group"
        )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def default_backend() -> str:
    """NCCL when CUDA is available with a GPU for every local rank, else Gloo."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        local_world = _env_int("LOCAL_WORLD_SIZE") or 1
        if torch.cuda.device_count() >= local_world:
            return "nccl"
    return "gloo"


def init_process_group(
    backend: str | None = None,
    *,
    init_method: str | None = None,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | timedelta | None = None,
) -> ProcessGroup:
    """Start the default process group and return it.

    Rank and world size come from the arguments or from the launcher's environment
    (`RANK`, `WORLD_SIZE`, with `MASTER_ADDR`/`MASTER_PORT` for the default `env://`
    rendezvous). The backend defaults to `default_backend()`. `timeout` (seconds or a
    timedelta) bounds every collective; default `PLAIT_TIMEOUT` seconds, else 600.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "the default process group is already initialized; call "
            "plait.comm.destroy_process_group() first to start a new one"
        )
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    missing = [n for n, v in (("RANK", rank), ("WORLD_SIZE", world_size)) if v is None]
    if missing:
        raise ValueError(
            f"cannot start the process group: {' and '.join(missing)} not set; start the "
            "script with `plait run` (or torchrun), or pass rank= and world_size="
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size {world_size})")
    if store is None and init_method is None:
        absent = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
        if absent:
            raise ValueError(
                f"cannot rendezvous: {' and '.join(absent)} not set; start the script with "
                "`plait run`, or pass store= or init_method="
            )
        init_method = "env://"
    backend = backend or default_backend()
    if timeout is None:
        timeout = float(os.environ.get("PLAIT_TIMEOUT", DEFAULT_TIMEOUT_S))
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    device_id = None
    if backend == "nccl":
        local_rank = _env_int("LOCAL_RANK") or 0
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    if backend == "gloo":
        shutdown.arm()  # destroy groups and let Gloo's workers finish before finalization
    return world_group()


def destroy_process_group() -> None:
    """Destroy every process group and forget the cached groups."""
    global _cached_under
    if dist.is_initialized():
        dist.destroy_process_group()
    _infos.clear()
    _groups_by_ranks.clear()
    _cached_under = None


def is_initialized() -> bool:
    return dist.is_initialized()


def world_group() -> ProcessGroup:
    """The default group of all ranks."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: call plait.comm.init_process_group() (or init_device_mesh) first"
        )
    return dist.group.WORLD


def global_rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def group_info(group: ProcessGroup) -> GroupInfo:
    """Facts about `group`, cached; raises a clear error for anything that is not a group
    this rank belongs to."""
    if not isinstance(group, ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup (from a DeviceMesh's get_group() "
            f"or plait.comm.new_group), got {type(group).__name__}"
        )
    name = group.group_name
    info = _infos.get(name)
    if info is None or info.group is not group or group not in _live:
        _follow_default_group()
        _check_alive(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"global rank {me} is not a member of group {name} with ranks {list(ranks)}")
        backend = str(dist.get_backend(group))
        if backend == "gloo":
            shutdown.arm()  # a group started by torch's own init_process_group
        info = _infos[name] = GroupInfo(name, ranks, ranks.index(me), backend, group)
    return info


def get_rank(group: ProcessGroup) -> int:
    """This process's rank within `group`."""
    return group_info(group).rank


def get_world_size(group: ProcessGroup) -> int:
    return group_info(group).size


def get_global_rank(group: ProcessGroup, rank: int) -> int:
    """The global rank of `group`'s member `rank`."""
    ranks = group_info(group).ranks
    if not 0 <= rank < len(ranks):
        raise ValueError(f"rank {rank} is not in [0, {len(ranks)}) for group with ranks {list(ranks)}")
    return ranks[rank]


def new_group(ranks: list[int] | tuple[int, ...]) -> ProcessGroup:
    """The group of these global ranks, created once per process and cached.

    A member's rank within the group is its position among the sorted global ranks.
    Only the members call this (c10d's local synchronization): a mesh creates one group
    per axis for the slice that contains this rank, not one for every slice. Members must
    ask for their groups in the same order, as every SPMD program does.
    """
    key = tuple(sorted(int(r) for r in ranks))  # c10d orders group ranks by global rank
    _follow_default_group()
    group = _groups_by_ranks.get(key)
    if group is not None:
        if group not in _live:
            # c10d names a locally synchronized group by its ranks, so a second one for the
            # same ranks in one life would rendezvous under the first one's store keys (hangs)
            raise StaleGroupError(
                f"the group of global ranks {list(key)} was destroyed on its own and c10d cannot "
                "make another for the same ranks until the default group is started again"
            )
        return group
    world = world_size()
    if len(set(key)) != len(key) or not key:
        raise ValueError(f"group ranks {list(key)} must be non-empty and distinct")
    bad = [r for r in key if not 0 <= r < world]
    if bad:
        raise ValueError(f"group ranks {bad} are not in [0, world_size {world})")
    if global_rank() not in key:
        raise ValueError(f"global rank {global_rank()} asked for group {list(key)} it is not a member of")
    if key == tuple(range(world)):
        group = world_group()
    else:
        group = dist.new_group(list(key), use_local_synchronization=True)
    _groups_by_ranks[key] = group
    return group
