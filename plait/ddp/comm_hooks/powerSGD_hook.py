"""PowerSGD (Vogels et al. 2019): low-rank gradient compression with error feedback and
warm start; torch's `PowerSGDState`, `powerSGD_hook` and `batched_powerSGD_hook`.

    first `start_powerSGD_iter` iterations: plain averaging all-reduce
    then, per bucket:   buffer += error                                  (error feedback)
      each gradient as a matrix M (n, m); small or not worth it -> sent uncompressed
      Q (m, r): last iteration's (warm start) or random, orthonormalized
      P = M Q  -> all-reduce [uncompressed | P] -> uncompressed / N; orthonormalize P
      Q = M^T P -> all-reduce Q, / N  ->  M ~ P Q^T (the average); error = input - P Q^T
    wire: r (n + m) numbers per matrix instead of n m

With r >= min(n, m) the approximation is exact: P Q^T = P P^T M_sum / N = M_sum / N.

The P all-reduce is waited inside the hook, on the training thread: a collective issued
from a future's callback would run on the backend's thread and could interleave with the
next bucket's collectives in a different order on different ranks. Only the Q all-reduce
overlaps the rest of backward.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.distributed import ProcessGroup

from plait import comm
from plait.ddp.buckets import GradBucket
from plait.ddp.comm_hooks.default_hooks import allreduce_fut


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each (n, r) matrix in the batch (B, n, r) orthonormal, in place."""
    rank = matrices.shape[-1]
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        q, _ = torch.linalg.qr(matrices)  # (B, n, r)
        matrices.copy_(q)
        return
    for i in range(rank):  # Gram-Schmidt: cheaper for the usual rank 1 or 2
        col = matrices[:, :, i:i + 1]  # (B, n, 1)
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        # an all-zero column (no gradient at all) stays zero instead of turning into NaN
        col /= norm + epsilon if epsilon else norm.clamp_min(torch.finfo(col.dtype).tiny)
        if i + 1 < rank:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGDState:
    """Settings and memory shared by every bucket's call (error, P and Q per bucket)."""

    __slots__ = [
        "process_group", "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
        "orthogonalization_epsilon", "use_error_feedback", "warm_start", "batch_tensors_with_same_shape",
        "rng", "error_dict", "p_memory_dict", "q_memory_dict", "iter", "total_numel_before_compression",
        "total_numel_after_compression",
    ]

    def __init__(self, process_group: ProcessGroup | None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 batch_tensors_with_same_shape: bool = False) -> None:
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                f"start_powerSGD_iter={start_powerSGD_iter}: with error feedback or warm start it "
                "must be > 1, because DDP rebuilds its buckets after the first iteration and the "
                "memories are kept per bucket"
            )
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.rng = torch.Generator().manual_seed(random_seed)  # same draws on every rank
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, numbers before, numbers after) summed over compressed calls."""
        after = self.total_numel_after_compression
        return (self.total_numel_before_compression / after if after else 0.0,
                self.total_numel_before_compression, after)


def _group(state: PowerSGDState, bucket: GradBucket) -> ProcessGroup:
    return state.process_group if state.process_group is not None else bucket.process_group


def _random_like(state: PowerSGDState, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.randn(shape, generator=state.rng, dtype=torch.float32).to(like.device, like.dtype)


def _feed_back_error(state: PowerSGDState, index: int, tensor: torch.Tensor) -> torch.Tensor | None:
    """Add last iteration's error to `tensor`; return a copy of the result (or None)."""
    if not state.use_error_feedback:
        return None
    error = state.error_dict.get(index)
    if error is None:
        state.error_dict[index] = torch.zeros_like(tensor)
    else:
        tensor.add_(error)
    return tensor.clone()


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Compress each gradient matrix of the bucket to rank `matrix_approximation_rank`."""
    group = _group(state, bucket)
    n_ranks = comm.get_world_size(group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_fut(group, buffer)
    index = bucket.index()
    input_copy = _feed_back_error(state, index, buffer)

    matrices, uncompressed = [], []
    for tensor in bucket.gradients():
        if tensor.dim() == 0:
            uncompressed.append(tensor)
            state.total_numel_before_compression += 1
            state.total_numel_after_compression += 1
            continue
        matrix = tensor.view(tensor.shape[0], -1)  # (n, m)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        state.total_numel_before_compression += n * m
        if (n + m) * r * state.min_compression_rate < n * m:
            matrices.append(matrix)
            state.total_numel_after_compression += (n + m) * r
        else:
            uncompressed.append(tensor)
            state.total_numel_after_compression += n * m

    by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)
    for matrix in matrices:
        by_shape[matrix.shape].append(matrix)
    batches = []  # (B, n, m) each: a single matrix's view into the buffer, or a stacked copy
    stacked: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    for same in by_shape.values():
        if state.batch_tensors_with_same_shape and len(same) > 1:
            batches.append(torch.stack(same))
            stacked.append((batches[-1], same))
        else:
            batches.extend(matrix.unsqueeze(0) for matrix in same)
    p_total = sum(b * min(n, m, state.matrix_approximation_rank) * n for b, n, m in (t.shape for t in batches))
    q_total = sum(b * min(n, m, state.matrix_approximation_rank) * m for b, n, m in (t.shape for t in batches))
    fresh = not state.warm_start or index not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[index] = buffer.new_empty(p_total)
        state.q_memory_dict[index] = buffer.new_empty(q_total)
    p_memory, q_memory = state.p_memory_dict[index], state.q_memory_dict[index]
    ps, qs, p_at, q_at = [], [], 0, 0
    for t in batches:
        b, n, m = t.shape
        r = min(n, m, state.matrix_approximation_rank)
        ps.append(p_memory[p_at:p_at + b * n * r].view(b, n, r))
        qs.append(q_memory[q_at:q_at + b * m * r].view(b, m, r))
        p_at, q_at = p_at + b * n * r, q_at + b * m * r
    for q in qs:
        if fresh:
            q.copy_(_random_like(state, tuple(q.shape), q))
        _orthogonalize(q, state.orthogonalization_epsilon)
    for t, p, q in zip(batches, ps, qs):
        torch.bmm(t, q, out=p)  # (B, n, m) @ (B, m, r) -> (B, n, r)

    flat_unc = [t.reshape(-1) for t in uncompressed]
    n_unc = sum(t.numel() for t in flat_unc)
    first = torch.cat([*flat_unc, p_memory])
    comm.all_reduce(first, group=group, op="sum")  # waited here: see the module note
    at = 0
    for tensor in uncompressed:
        tensor.copy_(first[at:at + tensor.numel()].view_as(tensor).div_(n_ranks))
        at += tensor.numel()
    p_memory.copy_(first[n_unc:])
    for p in ps:
        _orthogonalize(p, state.orthogonalization_epsilon)
    for t, p, q in zip(batches, ps, qs):
        torch.bmm(t.transpose(1, 2), p, out=q)  # (B, m, n) @ (B, n, r) -> (B, m, r)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        q_memory.div_(n_ranks)
        for t, p, q in zip(batches, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=t)  # (B, n, r) @ (B, r, m) -> (B, n, m)
        for batch, same in stacked:  # stacked batches are copies: write them back
            for k, matrix in enumerate(same):
                matrix.copy_(batch[k])
        if input_copy is not None:
            state.error_dict[index] = input_copy - buffer
        if not state.warm_start:
            state.p_memory_dict.pop(index, None)
            state.q_memory_dict.pop(index, None)
        return buffer

    state.maybe_increase_iter(bucket)
    return comm.all_reduce(q_memory, group=group, op="sum", async_op=True).get_future().then(decompress)


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Compress the whole bucket as one square matrix (side ceil(sqrt(numel)), zero-padded):
    fewer, larger matmuls and 2 * side * r numbers on the wire, but a coarser approximation."""
    group = _group(state, bucket)
    n_ranks = comm.get_world_size(group)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_fut(group, buffer)
    index = bucket.index()
    total = buffer.numel()
    side = math.ceil(math.sqrt(total))
    r = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += total
    state.total_numel_after_compression += 2 * side * r
    padded = buffer.new_zeros(side * side)
    padded[:total].copy_(buffer)
    input_copy = _feed_back_error(state, index, padded)
    matrix = padded.view(side, side)
    if not state.warm_start or index not in state.p_memory_dict:
        state.p_memory_dict[index] = buffer.new_empty(side, r)
        state.q_memory_dict[index] = _random_like(state, (side, r), buffer)
    p, q = state.p_memory_dict[index], state.q_memory_dict[index]
    _orthogonalize(q.unsqueeze(0), state.orthogonalization_epsilon)
    torch.matmul(matrix, q, out=p)  # (side, side) @ (side, r)
    comm.all_reduce(p, group=group, op="sum")  # waited here: see the module note
    _orthogonalize(p.unsqueeze(0), state.orthogonalization_epsilon)
    torch.matmul(matrix.t(), p, out=q)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        q.div_(n_ranks)
        torch.matmul(p, q.t(), out=matrix)
        if input_copy is not None:
            state.error_dict[index] = input_copy - padded
        if not state.warm_start:
            state.p_memory_dict.pop(index, None)
            state.q_memory_dict.pop(index, None)
        buffer.copy_(padded[:total])
        return buffer

    state.maybe_increase_iter(bucket)
    return comm.all_reduce(q, group=group, op="sum", async_op=True).get_future().then(decompress)


__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
