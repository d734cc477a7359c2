"""Gradients coming in: from a parameter's post-accumulate hooks to its bucket, and each
complete bucket's launch. The Reducer (reducer.py) takes this in as a base class: one object,
so the hot path pays no delegation frame.

    grad of param i   two post-accumulate hooks, both C calls, no Python frame:
                      `_arrived.append(param)`, then a tick of the countdown (next() pops a
                      callable off `_countdown` and calls it: a no-op but for the bottom one)
    countdown at 0    _take_in(): each arrived param, in arrival order, as a per-gradient hook
                      would have seen it -> _fill: its grad (or zeros) into its bucket view,
                      plain grads by one `_foreach_copy_` -> every complete bucket, in index
                      order, scaled by 1/N and launched (an async all-reduce, or the comm
                      hook's future on the sum) -> _arm(): the countdown set again

Invariant: `_countdown` is never empty while hooks can fire (a tick on an empty countdown
would raise inside autograd), and its bottom entry is `_take_in`. Its length is how many
more gradients may arrive before Python must look: the pending count of the next bucket in
launch order in BACKWARD; 1 where each gradient must be seen as it comes (PREPARED: the first
one begins the backward; DTensor parameters, whose local_grad may issue a tensor-parallel
collective; every bucket launched); a backward's worth in IDLE, where gradients only note
use (every phase change takes in first). That is what keeps backward's host cost at torch's
(whose reducer hooks are C++): a Python frame per bucket, not per gradient.

The attributes read here (phase, buckets, params, _where, _ready, _next, ...) are the
Reducer's; their meaning is documented there.
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
from collections.abc import Callable, Iterable

import torch
from torch.autograd.graph import get_gradient_edge

from plait import comm
from plait.ddp.buckets import Bucket, GradBucket
from plait.ddp.graph import twice_message
from plait.ddp.shards import as_grad, local_grad
from plait.tensor import DTensor

_NOOP = [].clear  # a C callable returning None: a countdown tick that runs no Python
_GRAD = operator.attrgetter("grad")


class Phase(enum.Enum):
    IDLE = "idle"  # no reduction expected: hooks only record use
    PREPARED = "prepared"  # a synced forward ran; the next backward reduces
    BACKWARD = "backward"  # backward running; finalize is queued


class GradientIntake:
    """The Reducer's gradient path: hooks, countdown, take-in, fill, launch."""

    def _install_hooks(self) -> None:
        """`_arrived.append(param)`, then a tick: next() pops a callable off `_countdown` and
        calls it, a no-op but for the bottom one, `_take_in`, which sets the countdown again.
        All C until the count runs out."""
        self._per_gradient = any(isinstance(p, DTensor) for p in self.params)
        self._arrived: list[torch.Tensor] = []
        self._countdown: list[Callable[[], None]] = []
        self._arm()
        tick = functools.partial(next, map(operator.call, iter(self._countdown.pop, None)))
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._arrived.append)
            p.register_post_accumulate_grad_hook(tick)  # (param) -> next(ticks, param) -> None
        # Each parameter's AccumulateGrad node, held for the reducer's life as torch's reducer
        # holds it: a leaf keeps only a weak reference, so without this every forward builds
        # the node again and every in-place op on the parameter (the optimizer's) looks for it
        # (AdamW's step on the host row: 20-25 us a step faster with the nodes held)
        self._grad_accumulators = [get_gradient_edge(p).node for p in self.params]

    def _arm(self) -> None:
        """Run `_take_in` at the gradient that can first complete the next bucket (its pending
        count from now); at every gradient where each must be seen as it comes; in IDLE, once
        a backward's worth has come (noting use waits: every phase change takes in first)."""
        if self.phase is Phase.BACKWARD:
            per_gradient = self._per_gradient or self._next >= len(self.buckets)
            count = 1 if per_gradient else self.buckets[self._next].pending
        else:
            count = len(self.params) if self.phase is Phase.IDLE else 1
        countdown = self._countdown
        countdown.clear()
        countdown.append(self._take_in)
        countdown.extend(itertools.repeat(_NOOP, count - 1))

    def _take_in(self) -> None:
        """The gradients that arrived since the last call, in arrival order, as a per-gradient
        hook would have seen each; then the countdown to the next call."""
        arrived = self._arrived
        if not arrived:  # a phase change with nothing new (the countdown itself always brings one)
            if not self._countdown:
                self._arm()
            return
        try:
            params = arrived[:]
            arrived.clear()
            ids = list(map(id, params))
            if self.phase is Phase.BACKWARD and not self.static_graph:  # the common path
                nxt = self._next
                bucket = self.buckets[nxt] if nxt < len(self.buckets) else None
                if (bucket is not None and ids == bucket.ids and bucket.pending == len(ids) and bucket.plain
                        and not self.gradient_as_bucket_view and not self._recording):
                    # the steady state (buckets rebuilt in ready order): exactly the next bucket's
                    # gradients, each once, in its order, plain tensors. _fill's effect with no
                    # step per gradient in Python (inline: a frame less each bucket)
                    ready, used = self._ready, self._local_used
                    for i in bucket.param_indices:
                        ready[i] = True
                        used[i] = 1
                    torch._foreach_copy_(bucket.views, list(map(_GRAD, bucket.params)))
                    bucket.pending = 0
                    self._launch_complete()
                else:
                    self._fill(map(self._index_of.__getitem__, ids))
            elif self.phase is Phase.IDLE:
                used = self._used_since_sync
                for i in map(self._index_of.__getitem__, ids):
                    used[i] = True
            else:
                for i in map(self._index_of.__getitem__, ids):
                    self._arrive(i)
        finally:
            if self.phase is Phase.BACKWARD and self._next >= len(self.buckets):
                countdown = self._countdown  # every bucket launched: _arm's count of 1, inline
                countdown.clear()  # (the end of each backward; a frame less)
                countdown.append(self._take_in)
            else:
                self._arm()

    def _arrive(self, i: int) -> None:
        """One gradient outside the common path (PREPARED, static_graph)."""
        if self.phase is Phase.IDLE:
            self._used_since_sync[i] = True
            return
        if self.phase is Phase.PREPARED:
            self.begin_backward()  # the loss did not come through the outputs (a captured tensor)
        if self.static_graph:
            if self._static_counts is None:  # first iteration: count, reduce at the end
                self._counts[i] += 1
                self._fire_order.append(i)
                return
            self._counts[i] -= 1
            if self._counts[i] > 0:
                return
            if self._counts[i] < 0:
                raise RuntimeError(twice_message(self.fqns[i]))
        self._fill((i,))

    def _mark_absent(self, i: int) -> None:
        """A parameter without a gradient this backward: its no_sync accumulation, or zeros."""
        self._fill((i,), zero=not (self._used_since_sync[i] and self.params[i].grad is not None))

    def _scale(self) -> float:
        """1 / the number of ranks whose gradients are summed (join: the notice's count, waited
        when the first bucket launches)."""
        if self._divisor is None:
            assert self._divisor_work is not None, "the divisor is the group's size unless join counts"
            self._divisor = float(self._divisor_work.wait().item())
        return 1.0 / self._divisor

    def _fill(self, indices: Iterable[int], zero: bool = False) -> None:
        """Parameters' gradients (or zeros) into their buckets, each complete bucket scaled by
        1/N and launched as soon as it is, in index order. One frame for many gradients: the
        loop is the host cost of backward, so it calls no Python helper on the plain-tensor
        path, and plain gradients are copied by one foreach op before a launch, not one op each."""
        ready, where, buckets, params, views_are_grads = (
            self._ready, self._where, self.buckets, self.params, self.gradient_as_bucket_view)
        record = self._recording
        copy_to: list[torch.Tensor] = []
        copy_from: list[torch.Tensor] = []
        for i in indices:
            if ready[i]:
                raise RuntimeError(twice_message(self.fqns[i]))
            ready[i] = True
            b, k = where[i]
            bucket = buckets[b]
            view = bucket.views[k]
            if zero:
                view.zero_()
            else:
                self._local_used[i] = 1
                param = params[i]
                if views_are_grads or isinstance(param, DTensor):
                    # DTensor parameters: the local shard, in the param's placements
                    grad = local_grad(param) if isinstance(param, DTensor) else param.grad
                    if not views_are_grads:
                        view.copy_(grad)
                    elif grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
                        view.copy_(grad)
                        param.grad = as_grad(param, view) if isinstance(param, DTensor) else view
                else:
                    copy_to.append(view)
                    copy_from.append(param.grad)
            if record:
                self._order.append(i)
            bucket.pending -= 1
            if bucket.pending == 0 and b == self._next:  # complete, and next in launch order
                if copy_to:  # what the launches read, in first
                    torch._foreach_copy_(copy_to, copy_from)
                    copy_to.clear()
                    copy_from.clear()
                self._launch_complete()
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)

    def _launch_complete(self) -> None:
        """Launch every complete bucket from the next one on, in index order: scaled by 1/N
        and all-reduced (or the comm hook's future, on the sum)."""
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            nxt = buckets[self._next]
            if self._hook is None:  # a comm hook gets the sum (torch's contract), the default 1/N of it
                nxt.buffer.mul_(1.0 / self._divisor if self._divisor is not None else self._scale())
                nxt.work = nxt.all_reduce.start()  # the door, prepared per bucket (_set_buckets)
            else:
                nxt.work = self._launch(nxt, nxt.buffer)
            self._next += 1

    def _launch(self, bucket: Bucket, buffer: torch.Tensor) -> object:
        if self._hook is None:
            return comm.all_reduce(buffer, group=self.group, op="sum", async_op=True)
        grad_bucket = GradBucket(bucket, buffer, is_last=bucket.index == len(self.buckets) - 1,
                                 process_group=self.group)
        fut = self._hook(self._hook_state, grad_bucket)
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future, or what .then() returns
            raise TypeError(f"comm hook {_name(self._hook)} returned {type(fut).__name__}; "
                            "it must return a torch.futures.Future holding the bucket's tensor")
        return fut


def _name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)
