"""ZeroRedundancyOptimizer: torch's ZeRO-1, each rank keeps optimizer state only for its partition.

    param groups (replicated) --sorted-greedy by numel, per group--> partition[rank] (same on every rank)
    step():  Join notice -> local optimizer steps partition[self.rank] (the only state it holds)
             -> every owner broadcasts its partition (per parameter, or one flat bucket per rank
                and device with parameters_as_bucket_view=True) -> every rank holds the same params
    consolidate_state_dict(to): each rank's local state_dict -> rank `to` (send/recv of bytes)
    state_dict() on `to`: those local states re-indexed to global indices, as a plain optimizer's

Invariant: each parameter has exactly one owner; only the owner holds and writes its optimizer
state. The partition is a pure function of the groups' sizes, so the ranks agree on it without
talking, and adding a group appends to it without moving the parameters already placed.
Under Join, a joined rank keeps stepping its partition with the gradients it holds (none after
zero_grad(), so its partition stands still, as in torch) and broadcasting it.

overlap_with_ddp=True: no step() of the user's; the partition is DDP's buckets and the step runs
per bucket inside DDP's backward, from the comm hook of plait.ddp.comm_hooks.ddp_zero_hook
(zero_overlap.py). Until its third backward builds the partition, no local optimizer exists.
"""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from plait import comm
from plait.ddp.join import Join, Joinable, JoinHook
from plait.optim.zero_overlap import OVERLAP_OPTIMIZERS, OverlapStatus, ZeroOverlap

logger = logging.getLogger(__name__)

__all__ = ["ZeroRedundancyOptimizer"]


class _ZeROJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        """A joined rank's step: update its partition from the gradients it holds and broadcast
        it, as the training ranks' step() expects. No join notice: the Join loop counted it."""
        self.zero._step_and_sync(None)


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap `optimizer_class` so that each rank of `process_group` (default: the world) steps
    and keeps state for about 1/world_size of the parameters, then broadcasts them; `defaults`
    go to `optimizer_class`. With `parameters_as_bucket_view`, each rank's parameters are views
    of one flat tensor (one broadcast per rank) and `param.data` changes. torch's semantics:

        ddp = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        loss_fn(ddp(x), y).backward(); opt.step(); opt.zero_grad()

    With `overlap_with_ddp=True` the step runs inside backward (the first two iterations do not
    step: DDP's buckets are not final yet) and step() only warns, as in torch:

        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=1e-3)
        ddp.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, opt))
        loss_fn(ddp(x), y).backward(); opt.zero_grad()
    """

    def __init__(self, params: Any, optimizer_class: type[Optimizer], process_group: ProcessGroup | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any) -> None:
        groups = self._init_params(params)
        self.initialized = False  # Optimizer.__init__ calls our add_param_group: partition later
        Optimizer.__init__(self, groups, defaults)
        Joinable.__init__(self)
        self.process_group = process_group if process_group is not None else comm.world_group()
        self.world_size: int = comm.get_world_size(self.process_group)
        self.rank: int = comm.get_rank(self.process_group)
        self.global_rank: int = comm.get_global_rank(self.process_group, self.rank)
        self._default_device = self._all_params[0].device
        self._partition_parameters_cache: list[list[dict]] = []
        self._param_to_rank_cache: dict[torch.Tensor, int] = {}
        self._is_trainable_mask = self._trainable_mask()
        self._overlap_with_ddp = overlap_with_ddp
        self._overlap: ZeroOverlap | None = None
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._buckets: list[list[torch.Tensor]] = []  # [device][rank] -> flat bucket
        if overlap_with_ddp:  # the local optimizer waits for DDP's final buckets (zero_overlap.py)
            self._check_overlap_args(optimizer_class, parameters_as_bucket_view)
            self._overlap = ZeroOverlap(self, optimizer_class, defaults)
        else:
            self.optim: Optimizer = optimizer_class(self._partition_parameters()[self.rank], **defaults)
            self._sync_param_groups(self.optim.param_groups, self.param_groups)  # the local defaults show outside
            self._build_param_buckets()
        self._all_state_dicts: list[dict[str, Any]] = []  # filled on the rank consolidated to
        self.initialized = True

    # -- parameters and their partition ------------------------------------------------

    def _init_params(self, params: Any) -> list:
        if isinstance(params, torch.Tensor):
            raise TypeError(f"params must be an iterable of Tensors or dicts, got {torch.typename(params)}")
        try:
            items = list(params)
        except TypeError:
            raise TypeError(f"params must be an iterable of Tensors or dicts, got {torch.typename(params)}") from None
        if not items:
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        if all(isinstance(p, torch.Tensor) for p in items):
            self._all_params = list(items)
        elif all(isinstance(g, dict) for g in items):
            if any("params" not in g for g in items):
                raise ValueError("every parameter group passed in params needs a 'params' key")
            items = [{**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])}
                     for g in items]
            self._all_params = [p for g in items for p in g["params"]]
        else:
            raise TypeError("params must be an iterable of Tensors or an iterable of dicts, not a mix")
        # one flat bucket per rank and device holds one dtype; torch has the same restriction
        types = sorted({torch.typename(p) for p in self._all_params})
        if len(types) > 1 or self._all_params[0].is_sparse:
            raise ValueError(f"ZeroRedundancyOptimizer needs every parameter of one dense type, got {types}")
        return items

    def _check_overlap_args(self, optimizer_class: type[Optimizer], parameters_as_bucket_view: bool) -> None:
        if optimizer_class not in OVERLAP_OPTIMIZERS:
            names = ", ".join(c.__name__ for c in OVERLAP_OPTIMIZERS)
            raise ValueError(f"overlap_with_ddp=True steps each DDP bucket on its own, which needs an optimizer "
                             f"that updates each parameter independently; {optimizer_class.__name__} is not one "
                             f"of torch's functional optimizers ({names}): pass one, or overlap_with_ddp=False")
        if len(self.param_groups) != 1:
            raise ValueError(f"overlap_with_ddp=True supports one parameter group (the partition is DDP's "
                             f"buckets), got {len(self.param_groups)}; pass overlap_with_ddp=False")
        if parameters_as_bucket_view:  # torch's warning: DDP's buckets are the flat tensors instead
            logger.warning("ZeroRedundancyOptimizer: parameters_as_bucket_view=True is ignored with "
                           "overlap_with_ddp=True; each owner's slice of a DDP bucket is one flat tensor instead")

    def _check_overlap_initialized(self) -> None:
        if self._overlap is not None and self._overlap.status is not OverlapStatus.INITIALIZED:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True has no local optimizer until the DDP comm "
                "hook builds it, in the third backward (the first two find DDP's final buckets); call this after")

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    def _partition_parameters(self, params_per_rank: list[list[torch.Tensor]] | None = None) -> list[list[dict]]:
        """Per rank, its param groups: each global group's hyperparameters with the parameters that
        rank owns. Sorted-greedy: largest first, each to the rank with the fewest elements so far
        (the first such rank on ties), the counts carried across groups. `params_per_rank` sets the
        partition by hand instead (one group only, before any partition was made)."""
        if params_per_rank is not None:
            if self._partition_parameters_cache:
                raise RuntimeError("params_per_rank can only be given before the parameters are partitioned")
            if len(self.param_groups) != 1:
                raise RuntimeError(f"params_per_rank supports one parameter group, this optimizer has "
                                   f"{len(self.param_groups)}")
            if len(params_per_rank) != self.world_size:
                raise ValueError(f"params_per_rank has {len(params_per_rank)} lists for world size {self.world_size}")
            known = set(self._all_params)
            if any(p not in known for ps in params_per_rank for p in ps):
                raise ValueError("params_per_rank holds a parameter not passed to the constructor")
            self._partition_parameters_cache = [[{**self.param_groups[0], "params": list(ps)}]
                                                for ps in params_per_rank]
        if not self._partition_parameters_cache:
            sizes = [0] * self.world_size
            parts: list[list[dict]] = [[] for _ in range(self.world_size)]
            for group in self.param_groups:
                owned: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
                for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):  # stable on ties
                    rank = sizes.index(min(sizes))
                    owned[rank].append(p)
                    sizes[rank] += p.numel()
                for rank in range(self.world_size):
                    parts[rank].append({**group, "params": owned[rank]})
            self._partition_parameters_cache = parts
        return self._partition_parameters_cache

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        if not self._param_to_rank_cache:
            self._param_to_rank_cache = {p: rank for rank, groups in enumerate(self._partition_parameters())
                                         for g in groups for p in g["params"]}
        return self._param_to_rank_cache

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (collective in effect: step() broadcasts by partition)."""
        if self.initialized and self._overlap is not None:
            raise RuntimeError("ZeroRedundancyOptimizer with overlap_with_ddp=True supports one parameter "
                               "group (the partition is DDP's buckets); add_param_group is not supported")
        super().add_param_group(param_group)
        if not self.initialized:
            return
        self._all_params.extend(self.param_groups[-1]["params"])
        self._is_trainable_mask = self._trainable_mask()
        self._partition_parameters_cache, self._param_to_rank_cache = [], {}
        self.optim.add_param_group(self._partition_parameters()[self.rank][-1])
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._build_param_buckets()

    def _build_param_buckets(self) -> None:
        """With parameters_as_bucket_view, each rank's trainable parameters on a device become
        views of one flat tensor, so step() broadcasts one tensor per rank and device."""
        if not self.parameters_as_bucket_view:
            return
        per_device: dict[torch.device, list[list[torch.Tensor]]] = {}
        for rank, groups in enumerate(self._partition_parameters()):
            for p in (p for g in groups for p in g["params"]):
                per_device.setdefault(p.device, [[] for _ in range(self.world_size)])[rank].append(p)
        self._buckets = []
        for device, per_rank in per_device.items():
            row = []
            for params in per_rank:
                trainable = [p for p in params if p.requires_grad]
                for p in params:
                    if not p.requires_grad:  # own storage: the old bucket it may view is dropped
                        p.data = p.data.detach().clone()
                if not trainable:  # every rank broadcasts one tensor per (device, rank): a stand-in
                    row.append(torch.zeros(1, dtype=params[0].dtype if params else torch.float32, device=device))
                    continue
                bucket = torch.empty(sum(p.numel() for p in trainable), dtype=trainable[0].dtype, device=device)
                offset = 0
                for p in trainable:
                    bucket[offset:offset + p.numel()].copy_(p.data.flatten())
                    p.data = bucket[offset:offset + p.numel()].view_as(p.data)
                    offset += p.numel()
                row.append(bucket)
            self._buckets.append(row)

    # -- the step ----------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's partition with the local optimizer, then broadcast every partition
        from its owner. Extra keywords go to the local optimizer's step. With overlap_with_ddp=True
        the step ran in backward: warn and return None, as torch."""
        if self._overlap is not None:
            if not self._overlap.hooked:
                raise RuntimeError(
                    "ZeroRedundancyOptimizer was built with overlap_with_ddp=True, but no DDP comm hook drives it, "
                    "so it never steps: ddp.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step("
                    "allreduce_hook, ddp, zero)), or construct it with overlap_with_ddp=False")
            logger.warning("ZeroRedundancyOptimizer: step() should not be in the training loop with "
                           "overlap_with_ddp=True (the DDP comm hook steps in backward); it does nothing")
            return None
        notice = Join.notify_join_context(self)
        loss = self._step_and_sync(closure, **kwargs)
        if notice is not None:
            notice.wait()
        return loss

    def _step_and_sync(self, closure: Callable[[], float] | None, **kwargs: Any) -> float | None:
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            logger.warning("ZeroRedundancyOptimizer: the trainable parameters changed; rebuilding the buckets")
            self._build_param_buckets()
            self._is_trainable_mask = mask
        self._sync_param_groups(self.param_groups, self.optim.param_groups)  # e.g. an LR scheduler's lr
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

    def _sync_params(self) -> None:
        handles = []
        for rank, groups in enumerate(self._partition_parameters()):
            if self.parameters_as_bucket_view:
                tensors = [row[rank] for row in self._buckets]
            else:
                tensors = [p.detach() for g in groups for p in g["params"]]
            handles += [comm.broadcast(t, src=rank, group=self.process_group, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()

    @staticmethod
    def _sync_param_groups(src: list[dict], dst: list[dict]) -> None:
        assert len(src) == len(dst), f"{len(src)} != {len(dst)} parameter groups"
        for s, d in zip(src, dst):
            d.update({k: v for k, v in s.items() if k != "params"})

    # -- state dict ----------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's local optimizer state on group rank `to` (call on every rank);
        `state_dict()` on `to` then returns the whole state."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to={to} is not a rank of the group (size {self.world_size})")
        self._check_overlap_initialized()
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        mine = self.optim.state_dict()
        self._all_state_dicts = []
        for rank in range(self.world_size):
            if rank == to and self.rank == to:
                self._all_state_dicts.append(_snapshot(mine))  # a copy: later steps must not change it
            elif rank == self.rank:
                _send_object(mine, dst=to, group=self.process_group, device=self._default_device)
            elif self.rank == to:
                self._all_state_dicts.append(_recv_object(src=rank, group=self.process_group,
                                                          device=self._default_device))

    def state_dict(self) -> dict[str, Any]:
        """The global state, as the wrapped optimizer's state_dict over all parameters would be;
        as of the last consolidate_state_dict to this rank."""
        self._check_overlap_initialized()
        if not self._all_state_dicts:
            raise RuntimeError(f"the optimizer state has not been consolidated on rank {self.rank}: call "
                               f"consolidate_state_dict(to={self.rank}) on every rank first")
        state_dict = Optimizer.state_dict(self)  # param_groups with global indices; no state held here
        index = {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in self.param_groups))}
        for rank, local in enumerate(self._all_state_dicts):
            groups = self._partition_parameters()[rank]
            assert len(local["param_groups"]) == len(groups), "local and global parameter groups differ"
            for local_group, group in zip(local["param_groups"], groups):
                for local_index, p in zip(local_group["params"], group["params"], strict=True):
                    if local_index in local["state"]:
                        state_dict["state"][index[p]] = local["state"][local_index]
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a global state (from state_dict()) on every rank: each keeps its partition's part."""
        self._check_overlap_initialized()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        for k, (saved, ours) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(ours["params"]):
                raise ValueError(f"parameter group {k} has {len(saved['params'])} parameters in the state "
                                 f"dict, {len(ours['params'])} in this optimizer")
        param_of = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                            chain.from_iterable(g["params"] for g in self.param_groups)))
        mine = self._partition_parameters()[self.rank]
        local_index = {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in mine))}
        local_state = {local_index[param_of[i]]: value for i, value in state_dict["state"].items()
                       if self._param_to_rank[param_of[i]] == self.rank}
        local_groups = [{**{k: v for k, v in saved.items() if k != "params"},
                         "params": [local_index[p] for p in group["params"]]}
                        for saved, group in zip(saved_groups, mine)]
        # deep-copied: the loaded state is this optimizer's own, not an alias of the caller's dict
        self.optim.load_state_dict({"state": copy.deepcopy(local_state), "param_groups": local_groups})
        self._sync_param_groups(saved_groups, self.param_groups)

    # -- Joinable --------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A joined rank keeps stepping and broadcasting its partition (no keyword arguments)."""
        if self._overlap is not None:  # torch cannot either: its join hook's broadcasts assert
            raise RuntimeError("ZeroRedundancyOptimizer with overlap_with_ddp=True cannot join: its step runs "
                               "inside DDP's backward, not in step(); pass overlap_with_ddp=False to use Join")
        return _ZeROJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group


def _snapshot(value: Any) -> Any:
    """A copy on the CPU of a nested state: tensors cloned, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _send_object(obj: Any, *, dst: int, group: ProcessGroup, device: torch.device) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
    comm.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), dst=dst, group=group)
    comm.send(payload, dst=dst, group=group)


def _recv_object(*, src: int, group: ProcessGroup, device: torch.device) -> Any:
    length = comm.recv(torch.zeros(1, dtype=torch.int64, device=device), src=src, group=group)
    payload = comm.recv(torch.empty(int(length.item()), dtype=torch.uint8, device=device), src=src, group=group)
    # weights_only: loading a peer's bytes runs no code (tensors, numbers, tuples only)
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
