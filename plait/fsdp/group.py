"""ParamGroup: the parameters of one `fully_shard` call, gathered and reduced together.

    SHARDED --unshard()--> [all-gather in flight] --wait_for_unshard()--> UNSHARDED
    UNSHARDED --reshard()--> SHARDED

    unshard:   padded shards -> all-gather input (S,) in param_dtype -> one all-gather
               -> (N, S) rank-major -> one copy-out -> flat buffer (N*S,) param-major,
               param i's block (N*P_i,) whose first numel_i elements are its unsharded view
    reshard:   the sharded DTensors go back on the module; the flat buffer's storage is
               resized to 0 (the views keep their shapes, the memory is freed)
    reshard_after_forward=k (an int): after forward, each rank keeps N/k rows of the (N, S)
               gathered shards (rows i with i % k == its place in its block of k consecutive
               shard ranks): SHARDED_POST_FORWARD. Backward's unshard all-gathers those within
               the block only (k ranks, (k, N/k, S) -> transpose -> (N, S)), as torch's
               post-forward mesh `mesh.view(-1, k)` does
    reduce:    (reduce.py) unsharded grads -> reduce-scatter input (N, S) rank-major, padding zeroed, in
               reduce_dtype -> one reduce-scatter (sum) on the shard axis -> (S,) -> HSDP:
               all-reduce on the replicate axis -> / data-parallel size (or gradient_divide_factor)
               -> sharded .grad

FSDP1's use_orig_params=False (fsdp1/flat_param.py): the (S,) all-gather input is the unit's
flat parameter itself (each sharded local a view of it: no copy-in), and the reduced (S,)
becomes its .grad (no per-parameter landing); the original names hold None between steps.

S is the sum of every parameter's padded shard numel P_i. The flat buffer is allocated once
and refilled in place, so tensors autograd saved in forward (the parameter, views of it)
see the values of the re-gather in backward.

Streams (an accelerator; on CPU `streams` is None and none of this runs), as torch's FSDP2:
    unshard:   copy_in.wait_stream(compute); copy-in on copy_in; all_gather.wait_stream(copy_in);
               all-gather waited on all_gather, event G recorded there
    wait:      compute.wait(G); copy-out on compute; event C; copy_in and all_gather wait(C);
               only then is the gather's input dropped (its output is dropped after the copy-out):
               neither buffer is reused before the collective and the copy-out are done with it
    reduce:    copy-in on compute; reduce_scatter.wait_stream(compute); reduce-scatter issued on
               reduce_scatter; drained there (waited, HSDP all-reduce, / dp, grads land): event R
               after the collective, P after the grads; compute.wait(R) before the input is
               dropped (the next group's post-backward), compute.wait(P) at the end of backward
"""

from __future__ import annotations

from enum import Enum, auto

import torch

from plait import comm
from plait.comm import device as streams_api
from plait.device_mesh import DeviceMesh
from plait.fsdp.param import FSDPParam
from plait.fsdp.reduce import GroupReduce, ReduceQueue

# Host cost: the loops below run per parameter at every unshard and reshard (the reduction's:
# reduce.py). For a plain parameter sharded on dim 0 (FSDPParam.rows_first, the common case)
# they do its work inline, in C calls only; any other parameter goes through FSDPParam's
# methods. Autograd is switched off with the C call (torch.no_grad() is five Python frames).
_set_grad_enabled = torch._C._set_grad_enabled


class ShardedState(Enum):
    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()  # reshard_after_forward=k: N/k rows kept, for a k-rank re-gather
    UNSHARDED = auto()


class FSDPStreams:
    """The side streams of FSDP on one device (shared by every group on it)."""

    __slots__ = ("all_gather", "copy_in", "reduce_scatter")

    def __init__(self, device: torch.device) -> None:
        self.copy_in = streams_api.side_stream(device, "fsdp.all_gather_copy_in")
        self.all_gather = streams_api.side_stream(device, "fsdp.all_gather")
        self.reduce_scatter = streams_api.side_stream(device, "fsdp.reduce_scatter")

    @staticmethod
    def on(device: torch.device) -> FSDPStreams | None:
        return None if streams_api.side_stream(device, "fsdp.all_gather") is None else FSDPStreams(device)


class ParamGroup(GroupReduce):
    """One all-gather and one reduce-scatter per step for every parameter in `params` (the
    reduce-scatter's side: reduce.py)."""

    def __init__(self, params: list[FSDPParam], mesh: DeviceMesh, *, device: torch.device,
                 param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, name: str) -> None:
        self.params = params
        self.mesh = mesh
        self.device = device
        self.name = name
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.world = mesh.size(mesh.ndim - 1)
        self.dp_size = mesh.size()
        dtypes = {p.orig_dtype for p in params}
        if param_dtype is None and len(dtypes) > 1:
            raise ValueError(
                f"fully_shard({name}) groups parameters of dtypes {sorted(map(str, dtypes))}; one "
                "all-gather needs one dtype: pass mp_policy=MixedPrecisionPolicy(param_dtype=...) or "
                "call fully_shard on the submodules separately"
            )
        self.param_dtype = param_dtype or next(iter(dtypes))
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.sizes = [p.padded_numel for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        self.total = sum(self.sizes)  # S
        self.state = ShardedState.SHARDED
        self._gather: comm.Handle | None = None
        self._flat: torch.Tensor | None = None  # (N*S,) param-major; storage freed when sharded
        self._partial: torch.Tensor | None = None  # HSDP: reduced on the shard axis only (no all-reduce)
        self._post: torch.Tensor | None = None  # (N/k, S) rows kept after forward (SHARDED_POST_FORWARD)
        self._post_gather = False  # the all-gather in flight is the k-rank one
        self.queue = ReduceQueue()  # replaced by the root's at lazy init
        self.streams = FSDPStreams.on(device)  # None on CPU: no stream calls in the step
        self._gather_event = None  # recorded on the all-gather stream after the collective
        # the all-gather's input (copy-in stream memory): alive until the copy-out's event is
        # waited for there, so a second gather in flight cannot reuse it before the first read it
        self._gather_input: torch.Tensor | None = None
        # knobs (FSDPModule.set_*)
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        # the sum over the data-parallel ranks is divided by this (None: their number, the mean);
        # torchtitan sets 1.0 and divides its loss by the global token count instead
        self.gradient_divide_factor: float | None = None
        # torch's switch from AVG / PREMUL_SUM to SUM then a division: plait's collectives
        # always reduce with SUM and divide after, so this is recorded, and true in effect
        self.force_sum_reduction_for_comms = False
        self.grad_dtype: torch.dtype | None = None  # the sharded .grad's; None: each parameter's own
        # FSDP1's use_orig_params=False: the (S,) flat parameter (each sharded local a view into
        # it) is the module's parameter, the all-gather input and, its .grad, the reduced (S,)
        # (plait/fsdp/fsdp1/flat_param.py); None: per-parameter DTensors, as fully_shard
        self.flat_param: torch.nn.Parameter | None = None
        self.unshard_count = 0  # all-gathers issued (tests count them)
        self.post_forward_size: int | None = None  # k of reshard_after_forward=k; None: reshard fully
        self.post_forward_group = None
        self._post_index = 0

    def set_post_forward_size(self, k: int | None) -> None:
        """reshard_after_forward=k: after forward keep what a k-rank all-gather rebuilds the
        parameters from; its group is this rank's block of k consecutive shard ranks."""
        assert self.state is ShardedState.SHARDED, f"{self.name}: {self.state}"
        self.post_forward_size, self.post_forward_group = k, None
        if k is None:
            return
        assert 1 < k < self.world and self.world % k == 0, (k, self.world)
        axis = self.mesh.ndim - 1
        ranks = self.mesh._slice_ranks(axis)  # the shard axis through this rank, in rank order
        me = self.mesh.get_local_rank(axis)
        block = me // k
        self._post_index = me % k
        self.post_forward_group = comm.new_group(ranks[block * k:(block + 1) * k])

    # -- parameters --------------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self.state is ShardedState.UNSHARDED

    @property
    def unsharded_bytes(self) -> int:
        """Bytes of the flat unsharded buffer (N*S elements in param_dtype)."""
        return self.world * self.total * self.param_dtype.itemsize

    @property
    def gather_pending(self) -> bool:
        return self._gather is not None

    def unshard(self, *, async_op: bool = False) -> None:
        """Issue the all-gather (unless unsharded or in flight); wait for it unless async_op."""
        if self.streams is not None and self._gather is None and self.state is not ShardedState.UNSHARDED:
            self._unshard_on_streams()
        elif self.state is ShardedState.SHARDED_POST_FORWARD and self._gather is None:
            self._gather = comm.all_gather(self._post.view(1, -1), group=self.post_forward_group, async_op=True)
            self._post_gather = True
            self.unshard_count += 1
        elif self.state is ShardedState.SHARDED and self._gather is None:
            inp = self._packed_shards()
            self._gather = comm.all_gather(inp.view(1, self.total), group=self.shard_group, async_op=True)
            self.unshard_count += 1
        if not async_op:
            self.wait_for_unshard()

    def _unshard_on_streams(self) -> None:
        """unshard() on an accelerator: copy-in and all-gather each on its stream (docstring)."""
        s, api = self.streams, streams_api
        compute = api.current_stream(self.device)
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            api.wait_stream(s.all_gather, compute)  # the kept rows were written on compute
            with api.stream_context(s.all_gather):
                handle = comm.all_gather(self._post.view(1, -1), group=self.post_forward_group, async_op=True)
                handle.wait()  # the stream waits, not the host (NCCL)
                self._gather_event = api.record_event(s.all_gather)
            self._post_gather = True
        else:
            api.wait_stream(s.copy_in, compute)  # the optimizer wrote the shards on compute
            with api.stream_context(s.copy_in):
                inp = self._packed_shards()
            api.wait_stream(s.all_gather, s.copy_in)
            with api.stream_context(s.all_gather):
                handle = comm.all_gather(inp.view(1, self.total), group=self.shard_group, async_op=True)
                handle.wait()
                self._gather_event = api.record_event(s.all_gather)
            self._gather_input = inp
        self._gather = handle
        self.unshard_count += 1

    def gather_full(self) -> list[torch.Tensor]:
        """Every parameter's whole value as a new tensor, from one all-gather, leaving the
        group sharded (state dicts: no flat buffer, no copy-out, no clone after it)."""
        assert self.state is ShardedState.SHARDED and self._gather is None, f"{self.name}: {self.state}"
        inp = self._packed_shards()
        with torch.no_grad():
            gathered = comm.all_gather(inp.view(1, self.total), group=self.shard_group, async_op=True).wait()
            return [p.full_from(gathered[:, off:off + size]) for p, off, size in
                    zip(self.params, self.offsets, self.sizes)]  # (N, S) -> each (N, P_i) -> its shape

    def _packed_shards(self) -> torch.Tensor:
        """This rank's shards, each refreshed from its parameter, packed at their offsets: (S,)."""
        flat = self.flat_param
        if flat is not None:  # already packed: the flat parameter itself (cast/moved if it must be)
            return flat.detach().to(device=self.device, dtype=self.param_dtype)
        inp = torch.empty(self.total, dtype=self.param_dtype, device=self.device)  # (S,)
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            for p, off, size in zip(self.params, self.offsets, self.sizes):
                module, name = p.sites[0]
                current = module._parameters.get(name)
                if current is not p.sharded and current is not p.unsharded and current is not None:
                    p.refresh_sharded()  # the user registered a parameter in our place
                if not p.rows_first:
                    p.copy_in(inp[off:off + size])
                    continue
                sharded, n = p.sharded, p.local_numel  # FSDPParam.copy_in, inline
                local = sharded._local if sharded._pending is None else sharded._local_tensor
                inp[off:off + n].copy_(local.reshape(-1))
                if n < size:
                    inp[off + n:off + size].zero_()
        finally:
            _set_grad_enabled(grad_was)
        return inp

    def wait_for_unshard(self) -> None:
        """Finish the all-gather in flight: copy out into the flat buffer, expose the views."""
        if self._gather is None:
            return
        gathered = self._gather.wait()  # (N, S), rank r's shards in row r
        self._gather = None
        streams = self.streams
        if streams is not None:
            compute = streams_api.current_stream(self.device)
            streams_api.wait_event(compute, self._gather_event)
            self._gather_event = None
        n, nbytes = self.world, self.world * self.total * self.param_dtype.itemsize  # unsharded_bytes
        if self._post_gather:  # (k, N/k * S): member j's rows are j, j + k, j + 2k, ...
            k = self.post_forward_size
            gathered = gathered.view(k, n // k, self.total).transpose(0, 1).reshape(n, self.total)
            self._post_gather, self._post = False, None
            self.state = ShardedState.SHARDED
        assert self.state is ShardedState.SHARDED, f"{self.name}: gather finished in state {self.state}"
        fresh = self._flat is None
        if fresh:
            self._flat = torch.empty(n * self.total, dtype=self.param_dtype, device=self.device)
        else:
            self._flat.untyped_storage().resize_(nbytes)
        flat, blocks, views = self._flat, [], []
        for off, size in zip(self.offsets, self.sizes):
            block = flat[n * off: n * (off + size)]
            blocks.append(block)
            views.append(block.view(n, size))
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            torch.split_with_sizes_copy(gathered, self.sizes, dim=1, out=views)
        finally:
            _set_grad_enabled(grad_was)
        dtype = self.param_dtype
        for p, block in zip(self.params, blocks):
            if fresh or p.unsharded is None or p.unsharded.dtype != dtype:
                p.bind(block)
            unsharded = p.unsharded
            for module, name in p.sites:  # FSDPParam.register, inline
                module._parameters[name] = unsharded
        self.state = ShardedState.UNSHARDED
        if streams is not None:  # the next gather reuses these buffers only after the copy-out
            copied = streams_api.record_event(compute)
            streams_api.wait_event(streams.copy_in, copied)
            streams_api.wait_event(streams.all_gather, copied)
            self._gather_input = None

    def reshard_after_forward_pass(self) -> None:
        """After forward: reshard fully, or to the post-forward rows (reshard_after_forward=k)."""
        k = self.post_forward_size
        if k is None or self.state is not ShardedState.UNSHARDED:
            self.reshard()
            return
        n = self.world
        post = torch.empty(n // k, self.total, dtype=self.param_dtype, device=self.device)  # (N/k, S)
        with torch.no_grad():
            for off, size in zip(self.offsets, self.sizes):
                rows = self._flat[n * off: n * (off + size)].view(n // k, k, size)  # (N/k, k, P_i)
                post[:, off:off + size].copy_(rows[:, self._post_index])
        self.reshard()
        self._post = post
        self.state = ShardedState.SHARDED_POST_FORWARD

    def reshard(self) -> None:
        """Back to the sharded parameters; free the unsharded memory (a gather in flight is
        waited for and dropped, and so are rows kept after forward)."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self._post_gather = False
            if self.streams is not None:  # the dropped buffers are reused only after the gather
                streams_api.wait_event(streams_api.current_stream(self.device), self._gather_event)
                streams_api.wait_event(self.streams.copy_in, self._gather_event)
                self._gather_event = self._gather_input = None
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self._post = None
            self.state = ShardedState.SHARDED
        if self.state is ShardedState.SHARDED:
            return
        flat = self.flat_param is not None  # then the original names hold no parameter between steps
        for p in self.params:
            sharded = None if flat else p.sharded
            for module, name in p.sites:  # FSDPParam.register, inline
                module._parameters[name] = sharded
        self._flat.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED


__all__ = ["FSDPStreams", "ParamGroup", "ShardedState"]
