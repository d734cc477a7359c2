"""Ring attention: exact softmax attention on a sequence sharded over a 1-D group.

    q (B, Hq, S/cp, D), k, v (B, Hkv, S/cp, D) local -> ring_attention(...) -> out (B, Hq, S/cp, D)

forward:  step i = 0..cp-1 holds the K/V of rank (r - i) mod cp; the plan (ring_plan) says
          which blocks of it this rank's queries meet; each block gives (out_blk, lse_blk),
          merged into fp32 accumulators by the log-sum-exp rule
          lse = logaddexp(lse, lse_blk), out = out*e^(lse_old-lse) + out_blk*e^(lse_blk-lse).
backward: the same ring again. With the final lse, p = exp(s - lse) is the block's share of
          the global softmax, so dq, dk, dv of each block are exact; dq stays home, the dK/dV
          of a visiting block ride the ring with it and arrive home after the last step
          ("alltoall"), or are reduce-scattered to their owners ("allgather").

Rotation ("alltoall" is p2p ring passing, torch's name): the next K/V transfer is posted
before the current block is computed, so it travels while this rank computes.
Communication per call on cp ranks (K and V packed in one buffer, in their dtype):
    allgather  forward 1 all_gather;          backward 1 all_gather + 1 reduce_scatter (fp32)
    alltoall   forward cp-1 send + cp-1 recv; backward (cp-1) + cp sends and as many recvs
GQA: q is viewed as (B, Hkv, G, S, D) and meets k, v as (B, Hkv, 1, S, D), so K/V are never
repeated and dK/dV sum over the G query heads of their group. Scores, softmax statistics and
gradients are fp32 whatever the input dtype (bf16 inputs: fp32 accumulation).
"""

from __future__ import annotations

import math

import torch
from torch.distributed import ProcessGroup

from plait import comm
from plait.tensor.experimental.ring_plan import Block, block_mask, ring_blocks

ROTATE_METHODS = ("allgather", "alltoall")


def _scores(q: torch.Tensor, k: torch.Tensor, block: Block, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hkv, G, sq, D) @ (B, Hkv, 1, D, sk) -> (.., sq, sk)
    mask = block_mask(block, s.size(-2), s.size(-1), device=s.device)
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: (out (B,Hkv,G,sq,D), lse (B,Hkv,G,sq)), fp32 inputs."""
    # TODO(speed, memory): plain matmuls run on every device and take any diagonal offset, but
    # hold the block's (sq, sk) fp32 scores for a moment; a fused kernel that returns the lse
    # (aten._scaled_dot_product_flash_attention on CUDA, ..._for_cpu here) would not, for
    # blocks whose mask it can express (none, or the top-left causal diagonal).
    s = _scores(q, k, block, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    delta: torch.Tensor, lse: torch.Tensor, block: Block,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of (dq, dk, dv) given the final lse and delta = sum(dout * out, -1)."""
    p = torch.exp(_scores(q, k, block, scale) - lse.unsqueeze(-1))  # (.., sq, sk) global probabilities
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2, keepdim=True)  # (B, Hkv, 1, sk, D)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2, keepdim=True) * scale
    return dq, dk, dv


class _Ring:
    """K/V (or any flat buffer) of each rank in ring order: `get(i)` is rank (r-i)'s buffer."""

    def __init__(self, buf: torch.Tensor, group: ProcessGroup, method: str, rank: int, size: int) -> None:
        self.group, self.method, self.rank, self.size = group, method, rank, size
        self.current, self.pending = buf, None
        if method == "allgather" and size > 1:
            self.pieces = comm.all_gather(buf, group=group).chunk(size)  # one collective for the ring

    def get(self, step: int) -> torch.Tensor:
        """The buffer of step `step`; posts the transfer for step+1 before returning (overlap)."""
        if self.method == "allgather":
            return self.pieces[(self.rank - step) % self.size] if self.size > 1 else self.current
        if self.pending is not None:
            for h in self.pending[0]:
                h.wait()
            self.current, self.pending = self.pending[1], None
        if step < self.size - 1:
            self.pending = _pass_on(self.current, self.group, self.rank, self.size)
        return self.current


def _pass_on(buf: torch.Tensor, group: ProcessGroup, rank: int, size: int):
    """Send `buf` to rank+1 and receive rank-1's into a new buffer; (handles, new buffer)."""
    incoming = torch.empty_like(buf)
    handles = comm.batch_isend_irecv([
        comm.P2POp("send", buf, (rank + 1) % size, group),
        comm.P2POp("recv", incoming, (rank - 1) % size, group),
    ])
    return handles, incoming


def _unpack(buf: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (k, v) flat buffer -> fp32 (B, Hkv, 1, S, D) views for the block math."""
    n = math.prod(shape)
    k, v = buf[:n].view(shape), buf[n:].view(shape)
    return k.float().unsqueeze(2), v.float().unsqueeze(2)


class _RingAttention(torch.autograd.Function):
    """Ring attention in forward; the ring again in backward, dK/dV carried home."""

    @staticmethod
    def forward(ctx, q, k, v, group, rank, size, is_causal, scale, load_balance, method):
        b, hq, sq, d = q.shape
        hkv, sk = k.size(1), k.size(2)
        qf = q.float().reshape(b, hkv, hq // hkv, sq, d)  # (B, Hkv, G, sq, D)
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        ring = _Ring(torch.cat([k.reshape(-1), v.reshape(-1)]), group, method, rank, size)
        for step in range(size):
            kf, vf = _unpack(ring.get(step), k.shape)
            for blk in ring_blocks(rank, size, step, sq, sk, is_causal=is_causal, load_balance=load_balance):
                o_blk, l_blk = _block_forward(qf[..., blk.q, :], kf[..., blk.k, :], vf[..., blk.k, :], blk, scale)
                o, lo = out[..., blk.q, :], lse[..., blk.q]
                new = torch.logaddexp(lo, l_blk)
                o.mul_(torch.exp(lo - new).unsqueeze(-1)).add_(o_blk * torch.exp(l_blk - new).unsqueeze(-1))
                lo.copy_(new)
        out_q = out.view(b, hq, sq, d).to(q.dtype)
        ctx.save_for_backward(q, k, v, out_q, lse)
        ctx.args = (group, rank, size, is_causal, scale, load_balance, method)
        return out_q

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, size, is_causal, scale, load_balance, method = ctx.args
        b, hq, sq, d = q.shape
        hkv, sk = k.size(1), k.size(2)
        grouped = (b, hkv, hq // hkv, sq, d)
        qf, doutf = q.float().reshape(grouped), dout.float().reshape(grouped)
        delta = (doutf * out.float().view(grouped)).sum(-1)  # (B, Hkv, G, sq)
        dq = torch.zeros_like(qf)
        ring = _Ring(torch.cat([k.reshape(-1), v.reshape(-1)]), group, method, rank, size)
        n = k.numel()
        dkv_all = torch.zeros(size, 2 * n, dtype=torch.float32, device=q.device) if method == "allgather" else None
        carried = None  # alltoall: the visiting block's dK/dV accumulator
        for step in range(size):
            kf, vf = _unpack(ring.get(step), k.shape)
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for blk in ring_blocks(rank, size, step, sq, sk, is_causal=is_causal, load_balance=load_balance):
                dq_b, dk_b, dv_b = _block_backward(
                    qf[..., blk.q, :], kf[..., blk.k, :], vf[..., blk.k, :], doutf[..., blk.q, :],
                    delta[..., blk.q], lse[..., blk.q], blk, scale)
                dq[..., blk.q, :] += dq_b
                dk[..., blk.k, :] += dk_b
                dv[..., blk.k, :] += dv_b
            mine = torch.cat([dk.reshape(-1), dv.reshape(-1)])
            if dkv_all is not None:
                dkv_all[(rank - step) % size] += mine
                continue
            if carried is not None:  # the accumulator rank-1 passed on after its step-1
                for h in carried[0]:
                    h.wait()
                mine += carried[1]
            if size == 1:
                carried = ([], mine)
                break
            carried = _pass_on(mine, group, rank, size)  # its handle keeps `mine` alive until sent
        if dkv_all is None:
            for h in carried[0]:
                h.wait()
            home = carried[1]  # after cp passes every accumulator is back with its owner
        else:
            home = comm.reduce_scatter(dkv_all.view(-1), group=group) if size > 1 else dkv_all[0]
        dk_home = home[:n].view(k.shape).to(k.dtype)
        dv_home = home[n:].view(v.shape).to(v.dtype)
        return dq.view(b, hq, sq, d).to(q.dtype), dk_home, dv_home, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: ProcessGroup,
                   is_causal: bool = False, scale: float | None = None, load_balance: bool = True,
                   rotate_method: str = "allgather") -> torch.Tensor:
    """Exact attention of local q (B, Hq, S, D) against every rank's k, v (B, Hkv, S, D)."""
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method must be one of {ROTATE_METHODS}, got {rotate_method!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring attention takes (batch, heads, seq, head_dim) tensors, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape or q.size(0) != k.size(0) or q.size(3) != k.size(3) or q.size(1) % k.size(1):
        raise ValueError(f"ring attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} must share "
                         f"batch and head_dim, and q's heads must be a multiple of k/v's")
    if is_causal and q.size(2) != k.size(2):
        raise ValueError(f"causal ring attention needs as many local queries as keys, got {q.size(2)} and {k.size(2)}")
    if is_causal and load_balance and q.size(2) % 2:
        raise ValueError(f"load-balanced causal ring attention needs an even local sequence (two chunks), "
                         f"got {q.size(2)}")
    rank, size = comm.get_rank(group), comm.get_world_size(group)
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, rank, size, is_causal, scale, load_balance, rotate_method)
