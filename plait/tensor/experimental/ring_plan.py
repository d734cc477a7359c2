"""Which attention blocks each context-parallel rank computes at each ring step: pure data.

    local_positions(rank, cp, seq_len, load_balance=True)   # global sequence positions rank holds
    ring_blocks(rank, cp, step, local_q, local_k, is_causal=..., load_balance=...)
        -> [Block(q=slice, k=slice, diagonal=int | None), ...]

The sequence is cut into `2*cp` chunks of `c = seq_len / (2*cp)` positions when load
balanced: rank `r` holds chunks `r` and `2*cp - 1 - r` (head and tail), so under a causal
mask every rank does the same work, `2*cp + 1` chunk pairs. Without load balancing rank `r`
holds chunk `r` of `cp` contiguous chunks (rank 0 then idles for most of a causal ring).

At ring step `i` rank `r` holds the K/V of rank `s = (r - i) mod cp`. A Block says which of
its local query rows meet which rows of that K/V block and with what mask: `diagonal=None`
is unmasked, `diagonal=d` lets query row `a` see key row `b` iff `b <= a + d` (the causal
diagonal shifted by `d`). Chunk pairs wholly above the causal diagonal are never listed:
they are neither computed nor masked. tests/tensor/test_context_parallel.py maps the blocks
back to global positions and checks every causal pair is computed exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """Local query rows `q` against rows `k` of the visiting K/V block; `diagonal` as above."""

    q: slice
    k: slice
    diagonal: int | None


def check_seq_len(seq_len: int, cp: int, *, load_balance: bool, what: str = "sequence") -> None:
    """The sequence must split into 2*cp chunks (load balanced) or cp chunks."""
    parts = 2 * cp if load_balance else cp
    if seq_len % parts:
        how = (f"2*cp = {parts} chunks (load-balanced layout: rank i holds chunks i and 2*cp-1-i)"
               if load_balance else f"cp = {parts} chunks")
        raise ValueError(f"context parallel: {what} length {seq_len} does not split into {how}; "
                         f"pad it to a multiple of {parts}")


def local_positions(rank: int, cp: int, seq_len: int, *, load_balance: bool = True) -> torch.Tensor:
    """The global positions (int64, ascending) rank `rank` of `cp` holds, in local order."""
    check_seq_len(seq_len, cp, load_balance=load_balance)
    if not load_balance:
        c = seq_len // cp
        return torch.arange(rank * c, (rank + 1) * c)
    c = seq_len // (2 * cp)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def shard_indices(cp: int, seq_len: int, *, load_balance: bool = True) -> torch.Tensor:
    """(seq_len,) int64: rank 0's positions, then rank 1's, ... (index_select -> shardable)."""
    return torch.cat([local_positions(r, cp, seq_len, load_balance=load_balance) for r in range(cp)])


def ring_blocks(rank: int, cp: int, step: int, local_q: int, local_k: int, *, is_causal: bool,
                load_balance: bool) -> list[Block]:
    """The blocks rank `rank` computes at ring step `step` (K/V of rank (rank - step) % cp)."""
    everything = [Block(slice(0, local_q), slice(0, local_k), None)]
    if not is_causal:  # every query sees every key, in whatever order the ranks hold them
        return everything
    assert local_q == local_k, (local_q, local_k)  # causal needs one layout for q and k/v
    src = (rank - step) % cp
    if not load_balance:  # contiguous chunks: own diagonal, earlier ranks whole, later none
        if src == rank:
            return [Block(slice(0, local_q), slice(0, local_k), 0)]
        return everything if src < rank else []
    c = local_q // 2
    head, tail, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
    if src == rank:
        # (head, head) and (tail, tail) are diagonal chunks; (tail, head) is below the
        # diagonal: one block of tail rows against both key chunks with the diagonal moved
        # right by c. (head, tail) lies above the diagonal and is skipped.
        return [Block(head, head, 0), Block(tail, both, c)]
    if src < rank:  # src's head precedes both of ours; src's tail follows both
        return [Block(both, head, None)]
    return [Block(tail, both, None)]  # src > rank: only our tail follows src's chunks


def block_mask(block: Block, rows: int, cols: int, *, device: torch.device | None = None) -> torch.Tensor | None:
    """(rows, cols) bool, True where the score is masked out; None for an unmasked block."""
    if block.diagonal is None:
        return None
    a = torch.arange(rows, device=device).unsqueeze(1)
    b = torch.arange(cols, device=device).unsqueeze(0)
    return b > a + block.diagonal
