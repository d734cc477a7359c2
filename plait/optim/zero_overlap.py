"""ZeRO overlapped with DDP (overlap_with_ddp=True): the partition is DDP's buckets, the step runs
per bucket inside DDP's backward, driven by plait.ddp.comm_hooks.ddp_zero_hook.

    backward 1        DDP's buckets are provisional (rebuilt at forward 2): UNINITIALIZED, no step
    backward 2        buckets final: RECORDING, each bucket's parameters are recorded, no step
    (static_graph=True: one backward later, as torch, see ddp_zero_hook._buckets_final)
    backward 3 ...    bucket 0's hook builds the partition (INITIALIZED), then per bucket:
                      all-reduce done -> the owner steps the bucket's parameters from the reduced
                      gradients -> every rank broadcasts each owner's flat slice of the bucket

Partition (torch's `_assign_bucket_subset_to_rank`): bucket k -> rank k % world_size; with
shard_buckets, the buckets (smallest first) are cut into slices of about total / world_size
elements, each to the rank with the fewest elements so far that holds no slice of that bucket.
Each owned slice's parameters become views of one flat tensor, the broadcast unit.

Invariant: a parameter is written only by its slice's owner, from the gradients of the
all-reduce that completed; every rank issues the same broadcasts in the same order (bucket index,
then owner rank), so no rank waits on a broadcast another rank has not issued.

The step: torch uses functional optimizers (`step(gradients)` with None for "skip"); plait uses
the plain torch.optim class. The rank's optimizer (`zero.optim`, over every slice it owns) holds
the state and hyperparameters; each owned slice has an optimizer of the same class over just its
parameters that borrows that state and those hyperparameters when it steps, with the reduced
gradients swapped into `.grad` for the step. The classes allowed are torch's eight with a
functional twin, all elementwise per parameter, so stepping slice by slice is the full step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plait import comm

if TYPE_CHECKING:
    from plait.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer

# torch's `functional_optim_map` keys: the optimizers overlap_with_ddp=True accepts
OVERLAP_OPTIMIZERS = (torch.optim.Adagrad, torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                      torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.Adamax)


class OverlapStatus(enum.Enum):
    UNINITIALIZED = "uninitialized"  # DDP has not rebuilt its buckets: no step
    DDP_HAS_REBUILT_BUCKETS = "recording"  # buckets final: this backward records them
    INITIALIZED = "initialized"  # the partition exists: every backward steps


@dataclass
class BucketAssignment:
    """Parameters `offset : offset + len(params)` of DDP bucket `bucket_index`, owned by one rank;
    `tensor` is their data, flat (the parameters are views of it)."""
    bucket_index: int
    params: list[torch.Tensor]
    offset: int
    tensor: torch.Tensor | None = None


def assign_bucket_slices(bucket_numels: list[list[int]], world_size: int,
                         shard_buckets: bool) -> list[list[tuple[int, int, int]]]:
    """Per rank, the (bucket, start, stop) parameter slices it owns, in the order assigned.

    Without shard_buckets bucket k goes whole to rank k % world_size. With it, torch's rule:
    buckets by increasing size; a slice closes before the parameter that would bring it to
    total / world_size elements (a slice holds at least one parameter); each slice goes to the
    rank with the fewest elements so far among those holding nothing of this bucket (lowest on ties);
    a bucket is cut into at most world_size slices (where torch would cut more, it raises).
    """
    if any(not numels for numels in bucket_numels):
        raise ValueError(f"DDP bucket {[len(n) for n in bucket_numels].index(0)} holds no parameters")
    slices: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    if not shard_buckets:
        for k, numels in enumerate(bucket_numels):
            slices[k % world_size].append((k, 0, len(numels)))
        return slices
    threshold = sum(map(sum, bucket_numels)) / world_size
    sizes = [0] * world_size

    def give(k: int, start: int, stop: int, holders: set[int], size: int) -> None:
        free = [r for r in range(world_size) if r not in holders]
        rank = min(free, key=lambda r: sizes[r])  # min() keeps the first of equals
        slices[rank].append((k, start, stop))
        holders.add(rank)
        sizes[rank] += size

    for k, numels in sorted(enumerate(bucket_numels), key=lambda item: sum(item[1])):  # stable
        holders: set[int] = set()
        start, size = 0, 0
        for i, numel in enumerate(numels):
            # the last free rank takes the rest: torch cuts on and fails ("All indices are disallowed")
            if size + numel >= threshold and i > start and len(holders) < world_size - 1:
                give(k, start, i, holders, size)
                start, size = i, 0
            size += numel
        give(k, start, len(numels), holders, size)
    return slices


@dataclass
class ZeroOverlap:
    """One ZeroRedundancyOptimizer's overlap state: the partition by buckets, and per iteration
    the buckets seen and the broadcasts in flight."""
    zero: ZeroRedundancyOptimizer
    optimizer_class: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    status: OverlapStatus = OverlapStatus.UNINITIALIZED
    shard_buckets: bool = False
    hooked: bool = False  # a ddp_zero_hook was built for this optimizer
    params_per_bucket: list[list[torch.Tensor]] = field(default_factory=list)
    assignments: list[dict[int, BucketAssignment]] = field(default_factory=list)  # [rank][bucket]
    ranks_per_bucket: list[list[int]] = field(default_factory=list)  # owners, ascending
    slice_optims: dict[int, torch.optim.Optimizer] = field(default_factory=dict)  # this rank's, by bucket
    # per iteration
    seen: list[int] = field(default_factory=list)
    broadcasts: list[Any] = field(default_factory=list)

    @property
    def num_buckets(self) -> int:
        return len(self.params_per_bucket)

    def setup(self, bucket: Any, ddp_has_rebuilt: bool) -> bool:
        """The status machine, run for each bucket before its step; True once the step runs."""
        if not ddp_has_rebuilt:
            assert self.status is OverlapStatus.UNINITIALIZED, self.status
            return False
        if self.status is OverlapStatus.UNINITIALIZED:
            self.status = OverlapStatus.DDP_HAS_REBUILT_BUCKETS
        if self.status is OverlapStatus.DDP_HAS_REBUILT_BUCKETS:
            if bucket.index() == 0 and self.params_per_bucket:  # one whole backward recorded
                self._initialize()
            else:
                assert bucket.index() == self.num_buckets, "DDP launched its buckets out of order"
                self.params_per_bucket.append(list(bucket.parameters()))
        return self.status is OverlapStatus.INITIALIZED

    def _initialize(self) -> None:
        zero = self.zero
        known = set(zero._all_params)
        for k, params in enumerate(self.params_per_bucket):
            for p in params:
                if p not in known:
                    raise ValueError(f"DDP bucket {k} holds a parameter of shape {tuple(p.shape)} that this "
                                     "ZeroRedundancyOptimizer was not given; build it over ddp.parameters()")
        numels = [[p.numel() for p in params] for params in self.params_per_bucket]
        slices = assign_bucket_slices(numels, zero.world_size, self.shard_buckets)
        self.assignments = [{k: BucketAssignment(k, self.params_per_bucket[k][a:b], a) for k, a, b in mine}
                            for mine in slices]
        self.ranks_per_bucket = [[r for r in range(zero.world_size) if k in self.assignments[r]]
                                 for k in range(self.num_buckets)]
        for per_rank in self.assignments:  # every rank holds every slice: the broadcast buffers
            for assignment in per_rank.values():
                assignment.tensor = torch.cat([p.detach().reshape(-1) for p in assignment.params])
                offset = 0
                for p in assignment.params:
                    p.data = assignment.tensor[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
        params_per_rank = [[p for a in per_rank.values() for p in a.params] for per_rank in self.assignments]
        zero._partition_parameters_cache, zero._param_to_rank_cache = [], {}
        zero._partition_parameters(params_per_rank)
        zero.optim = self.optimizer_class(zero._partition_parameters()[zero.rank], **self.defaults)
        zero._sync_param_groups(zero.optim.param_groups, zero.param_groups)
        hyper = {k: v for k, v in zero.optim.param_groups[0].items() if k != "params"}
        self.slice_optims = {k: self.optimizer_class([{**hyper, "params": a.params}])
                             for k, a in self.assignments[zero.rank].items()}
        self.status = OverlapStatus.INITIALIZED

    def step_bucket(self, bucket_index: int, reduced: torch.Tensor) -> None:
        """Step this rank's slice of bucket `bucket_index`; `reduced` is the bucket's flat
        all-reduced gradient (parameters back to back, in bucket order)."""
        zero = self.zero
        if zero._trainable_mask() != zero._is_trainable_mask:
            raise RuntimeError("ZeroRedundancyOptimizer with overlap_with_ddp=True does not support "
                               "changing which parameters require a gradient during training")
        assignment = self.assignments[zero.rank][bucket_index]
        start = sum(p.numel() for p in self.params_per_bucket[bucket_index][:assignment.offset])
        grads = []
        for p in assignment.params:
            grads.append(reduced[start:start + p.numel()].view_as(p))
            start += p.numel()
        optim = self.slice_optims[bucket_index]
        zero._sync_param_groups(zero.param_groups, zero.optim.param_groups)  # e.g. an LR scheduler's lr
        zero._sync_param_groups(zero.optim.param_groups, optim.param_groups)
        optim.state = zero.optim.state  # looked up each time: load_state_dict replaces it
        held = [p.grad for p in assignment.params]
        for p, g in zip(assignment.params, grads):
            p.grad = g
        try:
            optim.step()
        finally:
            for p, g in zip(assignment.params, held):
                p.grad = g

    def broadcast_bucket(self, bucket_index: int) -> None:
        """Every rank: launch the broadcast of each owner's slice of the bucket."""
        zero = self.zero
        for rank in self.ranks_per_bucket[bucket_index]:
            tensor = self.assignments[rank][bucket_index].tensor
            self.broadcasts.append(comm.broadcast(tensor, src=rank, group=zero.process_group, async_op=True))

    def finish_iteration(self) -> None:
        """Wait for every broadcast of this backward (the next forward needs the parameters)."""
        expected = sum(len(r) for r in self.ranks_per_bucket)
        assert len(self.broadcasts) == expected, f"{len(self.broadcasts)} broadcasts issued, {expected} expected"
        for handle in self.broadcasts:
            handle.wait()
        self.broadcasts.clear()
        self.seen.clear()
