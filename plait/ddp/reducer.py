"""The reducer: gradients -> buckets -> async all-reduce while backward runs -> averaged .grad.

    synced forward    prepare_for_backward(roots): IDLE -> PREPARED, iteration state reset
    backward starts   outputs' pre-hook -> begin_backward(): PREPARED -> BACKWARD, queue finalize,
                      mark the parameters this forward did not use
    grad of param i   post-accumulate hooks, two C calls and no Python frame: the param is
                      appended to `_arrived`, a countdown ticks -> at zero (the gradient
                      that can complete the next bucket) _take_in(): each arrived grad
                      into its bucket view -> every complete bucket, in index order, is
                      scaled by 1/N and launches its async all-reduce (or the comm hook's
                      future, on the sum) while backward goes on -> the countdown is set again
    end of backward   finalize(): mark what never came, wait buckets in order, write the
                      averaged .grads (copies, or the .grads already are the views) -> IDLE
    next forward      buckets rebuilt once, in the order gradients became ready

DTensor parameters (tensor parallel inside data parallel) are reduced on their local
shards; see shards.py.

Invariant: the phase goes IDLE -> PREPARED -> BACKWARD -> IDLE, and each synced backward
issues every bucket's collective exactly once, in bucket index order, on every rank (zeros
for what did not come), so the ranks' collectives always match. The gradient path (hooks,
countdown, take-in, fill, launch) is intake.py.

In IDLE (no_sync, eval, a second backward) hooks only note use; gradients accumulate in
`.grad` and the next synced backward reduces the sum. An iteration in which a parameter
got no gradient without find_unused_parameters still issues every bucket's collective
(zeros for the missing) so no peer hangs, then the next forward raises naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed import ProcessGroup

from plait import comm
from plait.ddp.buckets import assign_buckets, build_buckets, move_grad_views
from plait.ddp.graph import reachable_params, unused_message
from plait.ddp.intake import _GRAD, GradientIntake, Phase, _name
from plait.ddp.shards import as_grad, local
from plait.tensor import DTensor

__all__ = ["Phase", "Reducer"]

_NONE: frozenset[int] = frozenset()  # no parameter skipped: the common end of a backward
_PLAIN = {torch.Tensor}  # the types of a bucket's .grads that one foreach copy may write (none None)


class Reducer(GradientIntake):
    """Reduces the gradients of `named_params` over `group`, bucket by bucket, in backward."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], group: ProcessGroup, *,
                 caps: Sequence[int], find_unused_parameters: bool, static_graph: bool,
                 gradient_as_bucket_view: bool) -> None:
        self.fqns = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.caps = list(caps)
        self.find_unused_parameters = find_unused_parameters and not static_graph
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        self._hook: Callable | None = None
        self._hook_state: object = None
        self.phase = Phase.IDLE
        self.num_iterations = 0  # synced backward passes finalized (or shadowed while joined)
        # has_rebuilt, _rebuild_pending and `_recording` (whether this iteration's ready order is
        # recorded for the one rebuild): set only by _set_rebuild, so the condition lives there
        self._set_rebuild(pending=False, rebuilt=False)
        self._order: list[int] = []  # ready order of the iteration being recorded
        self._error: str | None = None
        n = len(self.params)
        self._used_since_sync = [False] * n  # used in no_sync steps since the last reduction
        self._static_counts: list[int] | None = None  # hook firings per param (static graph)
        self._static_unused: list[int] = []
        self._static_global_unused: set[int] = set()
        self._static_shadowed = False  # joined before the first static iteration (see shadow_backward)
        self._divisor_work = None  # join: a handle whose result is the non-joined count
        self._extra_work: list = []  # handles issued for this iteration, waited at finalize
        self._set_buckets(assign_buckets(self.params, list(reversed(range(n))), self.caps))
        # the iteration's state (_ready, _local_used, _next, _divisor, ...) is set by
        # prepare_for_backward from IDLE: nothing reads it before a synced forward
        self._install_hooks()  # intake.py

    # -- buckets ------------------------------------------------------------------------

    def _set_buckets(self, assignment: list[list[int]]) -> None:
        old = getattr(self, "buckets", [])
        self.buckets = build_buckets(self.params, self.fqns, assignment)
        for bucket in self.buckets:  # the default reduction, checked once, one frame an issue
            bucket.all_reduce = comm.prepare_all_reduce(bucket.buffer, group=self.group, op="sum")
        self._where = [(0, 0)] * len(self.params)  # param index -> (bucket, position)
        for bucket in self.buckets:
            for k, i in enumerate(bucket.param_indices):
                self._where[i] = (bucket.index, k)
        if self.gradient_as_bucket_view:
            move_grad_views(old, self.buckets)

    def _set_rebuild(self, *, pending: bool, rebuilt: bool) -> None:
        """The rebuild's state, and with it `_recording`: the ready order is recorded until a
        rebuild is pending or done, and never with find_unused_parameters."""
        self._rebuild_pending, self.has_rebuilt = pending, rebuilt
        self._recording = not (rebuilt or pending or self.find_unused_parameters)

    def rebuild_buckets(self) -> bool:
        """Once, after the first synced iteration: re-bucket in the order gradients became
        ready (rank 0's order, broadcast, so every rank builds the same buckets)."""
        if not self._rebuild_pending:
            return False
        order = torch.tensor(self._order, dtype=torch.int64, device=comm.group_device(self.group))
        comm.broadcast(order, src=0, group=self.group)
        order_list = order.tolist()
        assert sorted(order_list) == list(range(len(self.params))), "ready order is a permutation"
        self._set_rebuild(pending=False, rebuilt=True)
        self._set_buckets(assign_buckets(self.params, order_list, self.caps))
        return True

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        if not callable(hook):
            raise TypeError(f"a comm hook must be callable, got {type(hook).__name__}")
        if self._hook is not None:
            raise RuntimeError(f"a comm hook ({_name(self._hook)}) is already registered; "
                               "DDP takes one, registered before the first backward")
        if self.num_iterations or self.phase is Phase.BACKWARD:
            raise RuntimeError("register the comm hook before the first backward")
        self._hook, self._hook_state = hook, state

    def add_pending_work(self, handle: object, *, divisor: bool = False) -> None:
        """A handle issued for this iteration (join's notices), waited at finalize. With
        `divisor`, its result (the count of non-joined ranks) divides the gradients."""
        self._extra_work.append(handle)
        if divisor:
            self._divisor_work = handle
            self._divisor = None  # known once the notice's count is (_scale)

    # -- one iteration -----------------------------------------------------------------

    def prepare_for_forward(self, sync: bool) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(error)
        if self.phase is Phase.BACKWARD:
            missing = [self.fqns[i] for i, r in enumerate(self._ready) if not r]
            raise RuntimeError(
                "a forward started before the previous backward finished reducing gradients "
                f"(the backward raised or was interrupted); parameters still waiting: {missing}"
            )
        if not sync:
            self._take_in()  # what came in the last phase, as that phase saw it
            self.phase = Phase.IDLE
            self._arm()

    def prepare_for_backward(self, roots: Sequence[torch.Tensor]) -> None:
        if self._arrived:
            self._take_in()  # gradients of the phase before (no_sync's) are that phase's
        if self.phase is Phase.IDLE:  # a new iteration: its state, reset (set only here)
            n = len(self.params)
            self._ready = [False] * n
            self._local_used = [0] * n  # 1: this rank's gradient goes into the sum
            self._reachable: set[int] = set()  # find_unused_parameters: used by this iteration's forwards
            self._next = 0  # the next bucket to launch
            # the gradients' divisor: the group's size, or (join) the count a notice brings, waited lazily
            self._divisor: float | None = None if self._divisor_work is not None else float(self.world_size)
            self._fire_order: list[int] = []  # static graph, first iteration
            self._counts = [0] * n if self._static_counts is None else list(self._static_counts)
            if self._recording:
                self._order = []
            for bucket in self.buckets:
                bucket.pending, bucket.work = len(bucket.params), None
        if self.find_unused_parameters and roots:  # several forwards before one backward: the union
            self._reachable |= reachable_params(roots, self._index_of)
        elif self.find_unused_parameters:  # an output pytree cannot see into: find them at the end
            self._reachable = set(range(len(self.params)))
        self.phase = Phase.PREPARED
        if len(self._countdown) != 1:  # a gradient before the outputs' pre-hook begins the backward
            self._arm()

    def begin_backward(self, _grad_outputs: object = None) -> None:
        """PREPARED -> BACKWARD (the outputs' node pre-hook, or the first gradient)."""
        if self.phase is not Phase.PREPARED:
            return  # another output's pre-hook, or a backward with nothing to reduce
        self.phase = Phase.BACKWARD
        # on the graph task of the backward that reached the outputs (graph.py: why not a hook's)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if self.find_unused_parameters:
            for i in range(len(self.params)):
                if i not in self._reachable:
                    self._mark_absent(i)
        elif self._static_counts is not None:
            self._fill(self._static_unused, zero=True)
        self._arm()

    # -- end of backward -----------------------------------------------------------------

    def _finalize(self) -> None:
        """Every gradient is in: settle what never came, wait the buckets in order, write .grads."""
        assert self.phase is Phase.BACKWARD, self.phase
        try:
            if self._arrived:  # those since the last countdown (none where it ran out at the last bucket)
                self._take_in()
            skip = (self._settle_absent() if self.find_unused_parameters or self.static_graph or False in self._ready
                    else _NONE)  # parameters whose .grad stays as it is
            for handle in self._extra_work:
                handle.wait()
            self._extra_work.clear()
            # wait each bucket, write its averages: inline, the loop runs once per bucket per step
            hook, params, as_views = self._hook, self.params, self.gradient_as_bucket_view
            copy_to: list[torch.Tensor] = []  # the .grads that exist take the averages in one foreach op
            copy_from: list[torch.Tensor] = []
            for bucket in self.buckets:
                result = bucket.work.wait()
                if hook is not None:
                    if isinstance(result, (list, tuple)):
                        result = result[0]
                    if result is not bucket.buffer:
                        bucket.buffer.copy_(result)
                if skip is _NONE and bucket.plain and not as_views:  # the steady state: every .grad a plain tensor
                    grads = list(map(_GRAD, bucket.params))
                    if set(map(type, grads)) == _PLAIN:
                        copy_to += grads
                        copy_from += bucket.views
                        continue
                for k, i in enumerate(bucket.param_indices):
                    if i in skip:
                        continue
                    param, view = params[i], bucket.views[k]
                    if as_views:
                        if param.grad is None or local(param.grad).data_ptr() != view.data_ptr():
                            param.grad = as_grad(param, view)
                    elif param.grad is None:
                        param.grad = as_grad(param, view.clone())
                    else:  # local(), inlined: once per parameter per step
                        grad = param.grad
                        copy_to.append(grad._local_tensor if isinstance(grad, DTensor) else grad)
                        copy_from.append(view)
            if copy_to:
                torch._foreach_copy_(copy_to, copy_from)
            if self._recording and len(self._order) == len(self.params):
                self._set_rebuild(pending=True, rebuilt=False)
        finally:
            self.phase = Phase.IDLE
            self.num_iterations += 1
            self._used_since_sync = [False] * len(self.params)
            self._divisor_work = None
            # the countdown stays: 1 after the last bucket (the first no_sync gradient re-arms it)

    def _settle_absent(self) -> set[int]:
        """The parameters without a gradient this backward: reduced as their no_sync sum or
        zeros (peers wait for their buckets), a first static iteration reduced whole, the
        globally unused agreed on; returns those whose .grad is left as it is."""
        first_static = self.static_graph and self._static_counts is None
        if first_static:  # delayed: every gradient is in, reduce all now
            for i, count in enumerate(self._counts):
                self._local_used[i] = int(count > 0)
                self._fill((i,), zero=count == 0)
        skip: set[int] = set()
        if False in self._ready:
            missing = [i for i, r in enumerate(self._ready) if not r]
            if self.find_unused_parameters:  # reachable, but no gradient came
                for i in missing:
                    self._mark_absent(i)
            else:
                names = [self.fqns[i] for i in missing]
                self._error = unused_message(names, comm.get_rank(self.group), self.static_graph)
                self._fill(missing, zero=True)  # peers wait for these buckets: send zeros
                skip.update(missing)
        if self.find_unused_parameters or first_static:
            used = torch.tensor(self._local_used, dtype=torch.int32, device=comm.group_device(self.group))
            comm.all_reduce(used, group=self.group, op="sum", async_op=True).wait()
            globally_unused = {i for i, u in enumerate(used.tolist()) if u == 0}
            skip |= globally_unused
            if first_static:
                self._record_static_graph(globally_unused)
        elif self._static_counts is not None:
            skip |= self._static_global_unused
        return skip

    def _record_static_graph(self, globally_unused: set[int]) -> None:
        self._static_counts = list(self._counts)
        self._static_unused = [i for i, c in enumerate(self._counts) if c == 0]
        self._static_global_unused = globally_unused
        if self._recording:  # ready order: each parameter's last firing, unused ones last
            last = {i: pos for pos, i in enumerate(self._fire_order)}
            self._order = sorted(last, key=last.__getitem__)
            self._order += [i for i in reversed(range(len(self.params))) if i not in last]

    # -- join ----------------------------------------------------------------------------

    def shadow_backward(self) -> None:
        """A joined rank's stand-in for a backward: the same collectives, zeros in."""
        works = [self._launch(b, torch.zeros_like(b.buffer)) for b in self.buckets]
        first_static = self.static_graph and self._static_counts is None and not self._static_shadowed
        if self.find_unused_parameters or first_static:
            works.append(comm.all_reduce(torch.zeros(len(self.params), dtype=torch.int32, device=comm.group_device(self.group)),
                                         group=self.group, op="sum", async_op=True))
        # A rank that joins before its first static_graph iteration never learns the graph:
        # it shadows correctly, but cannot train again after the Join.
        self._static_shadowed = self._static_shadowed or first_static
        for work in works:
            work.wait()
        self.num_iterations += 1
        if self._recording:  # rebuild when the others do (everyone takes rank 0's order)
            self._order = [i for b in self.buckets for i in b.param_indices]
            self._set_rebuild(pending=True, rebuilt=False)
