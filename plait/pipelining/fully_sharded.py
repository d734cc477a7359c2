"""A stage whose submodule is `fully_shard`-ed: one all-gather and one reduce-scatter per group
per step, whatever the number of microbatches.

    step starts        ShardedGradSync.begin_step(): every FSDP group of the stage keeps its
                       unsharded params for the whole step (reshard after forward and after
                       backward off), per-backward gradient sync off, not the last backward;
                       then all groups' all-gathers are issued together and waited for
    each F / B / I / W the unsharded params are registered on the modules: B and W accumulate
                       into their .grad (W writes .grad itself); FSDP's post-backward only
                       keeps the sum (accumulate_unsharded), nothing is sent
    after each B | W   ShardedGradSync.after_backward(): with a reduce_dtype wider than
                       param_dtype, the microbatch's .grad is added to the running sum in
                       reduce_dtype (FSDP's own no-sync accumulation; W runs after the
                       post-backward that would do it)
    stage's m-th B|W   ShardedGradSync.last_backward(): sync on, reshard after backward on,
                       last backward; every group's post-backward runs by hand: reshard, then
                       one reduce-scatter of the summed unsharded grads (queued: the next
                       group's waits for the one before, the last is in flight while the
                       pipeline goes on)
    step ends          ShardedGradSync.end_step(): the last reduce-scatter waited for (grads
                       are now sharded DTensors, averaged over dp), every group resharded, the
                       user's knobs restored; then the schedule's scale_grads (/= m) divides
                       the sharded grads, as torch's does after its REDUCE_GRAD

This is what torch's pipelining does with an FSDPModule (`backward_maybe_with_nosync` turns
sync and reshard-after-backward off per backward; `perform_reduce_grad` turns them on and
calls each param group's post_backward and the root's final callback; its multi-stage
runtime unshards a stage once), done here for every schedule.

Why unshard once, not per microbatch: the split backward's W re-runs autograd nodes that
saved the unsharded params; a reshard in between would free the storage they read. And it
is the point of PP x FSDP: the all-gather is paid once per step, not 2m times. The cost is
memory: a stage holds its unsharded params for the step, as DDP would.

Why I and W work unchanged: while unsharded, the registered parameters are the unsharded
nn.Parameters (autograd leaves, one object per param for the life of the module), so the
stage's `submod.parameters()` are the leaves its backward computes grads for; the sharded
DTensors are registered again (with their reduced grads) only after end_step.
"""

from __future__ import annotations

from torch import nn

from .data_parallel import GradSync, register_grad_sync


class ShardedGradSync:
    """The FSDP roots of one stage's submodule (itself, or its top-level sharded children)."""

    def __init__(self, roots: list[nn.Module]) -> None:
        self.roots = roots
        self.states = []
        for root in roots:
            state = root._plait_fsdp_state
            if state.is_root is False:
                orig = type(root).__mro__[2].__name__  # FSDP<Class>, FSDPModule, <Class>
                raise ValueError(
                    f"fully_shard({orig}) in this stage was initialised under a root outside "
                    "the stage (a forward ran through an enclosing FSDP module first): its "
                    "gradients would be reduced by that root; call fully_shard on the stage's "
                    "own modules and run forward only through the pipeline"
                )
            self.states.append(state)
        self._saved: list[tuple] | None = None
        self._last: list[bool] = []
        self._widening: list = []

    def _groups(self):
        groups = []
        for root in self.roots:
            groups += root._groups(recurse=True)
        return groups

    def begin_step(self) -> None:
        assert self._saved is None, "begin_step twice without end_step"
        for state in self.states:
            state.lazy_init()  # the stage's module is the root, as its first forward would make it
        groups = self._groups()
        self._saved = [
            (g, g.reshard_after_forward, g.reshard_after_backward, g.requires_gradient_sync)
            for g in groups
        ]
        self._last = [state.ctx.is_last_backward for state in self.states]
        self._widening = [g for g in groups if g.reduce_dtype != g.param_dtype]  # per B|W: cached
        for g in groups:
            g.reshard_after_forward = False
            g.reshard_after_backward = False
            g.requires_gradient_sync = False
        for root in self.roots:
            root.set_is_last_backward(False)
        for g in groups:  # all gathers in flight at once, then wait
            g.unshard(async_op=True)
        for g in groups:
            g.wait_for_unshard()

    def after_backward(self) -> None:
        # What FSDP's post-backward does without sync, after every microbatch's weight
        # grads: with a reduce_dtype wider than param_dtype, the sum is kept in it. A W
        # writes .grad after the post-backward its I triggered, and several W may run back
        # to back (zero-bubble), which would otherwise add bf16 grads in bf16.
        for g in self._widening:
            for p in g.params:
                p.accumulate_unsharded(g.reduce_dtype)

    def last_backward(self) -> None:
        for root in self.roots:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
            root.set_is_last_backward(True)
        for state in self.states:
            # reverse registration order: the innermost (last in forward) groups first, as
            # FSDP's own backward would reach them
            for s in reversed(state.ctx.states):
                if s.group is not None:
                    s.group.post_backward()  # reshard, one reduce-scatter (queued)

    def end_step(self) -> None:
        from plait.fsdp.state import TrainingState  # a layer below; imported late: optional

        for state in self.states:
            state.ctx.queue.drain()  # the reduced grads land in the sharded .grad
            for s in state.ctx.states:
                if s.group is not None:
                    s.group.reshard()
                s.training_state = TrainingState.IDLE
        for g, after_fwd, after_bwd, sync in self._saved or ():
            g.reshard_after_forward = after_fwd
            g.reshard_after_backward = after_bwd
            g.requires_gradient_sync = sync
        for state, last in zip(self.states, self._last):
            state.ctx.is_last_backward = last
        self._saved = None


def _roots(module: nn.Module) -> list[nn.Module]:
    """`module` if it is sharded, else its sharded submodules with no sharded ancestor."""
    roots: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if "_plait_fsdp_state" in m.__dict__:
            roots.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return roots


def _plait_fsdp(module: nn.Module) -> GradSync | None:
    roots = _roots(module)
    if not roots:
        return None
    return ShardedGradSync(roots)


register_grad_sync(_plait_fsdp)
