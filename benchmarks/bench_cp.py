"""Context parallel: ring attention (plait.tensor.experimental.context_parallel) on cp = 1, 2, 4
ranks against one process running the same global sequence.

    activations   bytes one causal attention call saves for backward on a rank
                  (saved_tensors_hooks, each storage once: q, k, v, out, fp32 lse); goal
                  proportional to 1/cp (the ratio column: cp * bytes(cp) / bytes(1))
    bytes         bytes each rank sends per call, forward + backward, as plait.comm reports
                  them, against the ring's formula with |KV| this rank's K and V and |dKV|
                  their fp32 gradients: alltoall (cp-1)|KV| fwd, (cp-1)|KV| + cp|dKV| bwd;
                  allgather (ring all-gather / reduce-scatter) (cp-1)|KV| fwd,
                  (cp-1)|KV| + (cp-1)|dKV| bwd
    exposed       seconds this rank waits on K/V or dK/dV transfers (time inside the ring's
                  gather and waits) as a share of the call's time: what the block compute
                  does not hide (Gloo on CPU: transfers are memory copies between processes)
    time          forward + backward of one call, slowest rank, median; ratio against one
                  process's torch SDPA (the fused CPU kernel) on the whole sequence

    longest seq   the longest global sequence whose saved activations + parameters per rank
                  (largest rank's) fit a fixed budget, the bytes cp 1 needs at a base sequence,
                  for cp 1 and 8: a small Llama-style stack, one forward + backward per
                  candidate, doubling from 16 cp then bisecting on multiples of 2 cp; goal 8x

torch's own context_parallel is tried on cp 2 and, on CPU, does not run (its error is printed):
its ring dispatches the CPU flash kernel through DTensor, which has no sharding strategy for it
(the error raised inside the block is the one printed, not one from restoring the buffers).
Gloo, one thread per rank (plait.testing's pool); B=1, 8 query heads, 4 K/V heads, head dim 64.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from benchmarks.common import human_bytes, median, print_table, ratio, slowest_rank_time
from plait import comm
from plait.debug import CommDebugMode
from plait.device_mesh import init_device_mesh
from plait.tensor.experimental import context_parallel, set_rotate_method
from plait.tensor.experimental import ring_attention as ring
from plait.testing import run_distributed

HQ, HKV, D = 8, 4, 64
DIM, HID, SD = 128, 256, 16  # the budget table's Llama-style stack: width, SwiGLU hidden, head dim


def _inputs(seq: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, seq, D, generator=g) for h in (HQ, HKV, HKV, HQ)]


def _saved_bytes(fn, backward=None) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    if backward is not None:
        backward(out)
    del out
    return sum(seen.values())


class _WaitClock:
    """Time this rank spends in the ring's communication: all-gather, reduce-scatter, posting
    the p2p batches and waiting on their handles (K/V and dK/dV alike)."""

    def __init__(self) -> None:
        from plait.comm.work import Handle

        self.seconds, self.handle = 0.0, Handle
        self.saved = (ring.comm.all_gather, ring.comm.reduce_scatter, ring.comm.batch_isend_irecv, Handle.wait)

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return run

    def __enter__(self):
        gather, scatter, batch, wait = (self._timed(f) for f in self.saved)
        ring.comm.all_gather, ring.comm.reduce_scatter, ring.comm.batch_isend_irecv = gather, scatter, batch
        self.handle.wait = wait
        return self

    def __exit__(self, *exc):
        ring.comm.all_gather, ring.comm.reduce_scatter, ring.comm.batch_isend_irecv, self.handle.wait = self.saved


def _torch_cp_error(seq: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.experimental import context_parallel as torch_cp

    mesh = torch_mesh("cpu", (comm.world_size(),))
    shards = [t.clone() for t in _inputs(seq)]
    first: list[Exception] = []  # the error inside the block: restoring buffers on exit may raise another
    try:
        with torch_cp(mesh, buffers=shards, buffer_seq_dims=[2] * 4):
            try:
                q, k, v = (t.clone().requires_grad_() for t in shards[:3])
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(shards[3])
            except Exception as e:  # noqa: BLE001 - we print whatever stops it
                first.append(e)
                raise
    except Exception as e:  # noqa: BLE001
        e = first[0] if first else e
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return "ran"


def _measure(mesh, method: str, seq: int, rounds: int, group) -> dict:
    set_rotate_method(method)
    shards = [t.clone() for t in _inputs(seq)]
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4):
        leaves = [t.clone().requires_grad_() for t in shards[:3]]

        def attend():
            return F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)

        def call():
            attend().backward(shards[3])

        saved = _saved_bytes(attend)
        with CommDebugMode() as mode:
            call()
        call()  # warm
        times, waits = [], []
        for _ in range(rounds):
            with _WaitClock() as clock:
                times.append(slowest_rank_time(call, group))
            waits.append(clock.seconds)
        kv = 2 * leaves[1].numel() * 4
    return {"saved": saved, method: dict(bytes=sum(mode.comm_bytes.values()), time=median(times),
                                         exposed=median(waits) / median(times), kv=kv)}


def _worker(seq: int, rounds: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cp = comm.world_size()
    group = comm.world_group()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    out: dict = {"cp": cp}
    for method in ("alltoall", "allgather"):
        out.update(_measure(mesh, method, seq, rounds, group))
    set_rotate_method("allgather")
    if cp == 1:
        q, k, v, dout = (t.clone().requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(seq)))
        out["saved_sdpa"] = _saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                 enable_gqa=True))

        def single():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)
        single()
        out["sdpa_time"] = median([slowest_rank_time(single, group) for _ in range(rounds)])
    if cp == 2:
        out["torch"] = _torch_cp_error(seq)
    return out


class _Block(torch.nn.Module):
    """Pre-norm Llama block: RMSNorm, causal GQA attention (HQ / HKV heads of SD), SwiGLU.
    No rope: positions change no saved tensor's size."""

    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)
        self.q, self.kv = torch.nn.Linear(DIM, HQ * SD, bias=False), torch.nn.Linear(DIM, 2 * HKV * SD, bias=False)
        self.o = torch.nn.Linear(HQ * SD, DIM, bias=False)
        self.up, self.down = torch.nn.Linear(DIM, 2 * HID, bias=False), torch.nn.Linear(HID, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, s, HQ, SD).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, HKV, SD).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, HQ * SD))
        g, u = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def _stack_bytes(model, mesh, seq: int, group) -> int:
    """Saved activations + parameters, the largest rank's, of one forward + backward at global `seq`."""
    x = torch.randn(1, seq, DIM, generator=torch.Generator().manual_seed(seq))
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        saved = _saved_bytes(lambda: model(x), backward=lambda out: out.sum().backward())
    model.zero_grad(set_to_none=True)  # gradients are not in the budget: they are freed by the step
    total = torch.tensor([saved + sum(p.nbytes for p in model.parameters())])
    comm.all_reduce(total, group=group, op="max")
    return int(total.item())


def _longest_worker(budget: int | None, budget_seq: int, layers: int) -> dict:
    """Longest global sequence whose per-rank bytes fit `budget` (None: the bytes at `budget_seq`):
    double from 16 cp, then bisect on multiples of 2 cp (the load-balanced shard's unit)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cp, group = comm.world_size(), comm.world_group()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    set_rotate_method("alltoall")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block() for _ in range(layers)])
    budget = _stack_bytes(model, mesh, budget_seq, group) if budget is None else budget
    seen: dict[int, int] = {}

    def fits(seq: int) -> bool:
        seen[seq] = _stack_bytes(model, mesh, seq, group)
        return seen[seq] <= budget

    step, t0 = 2 * cp, time.perf_counter()
    lo, hi = 0, 8 * step
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return dict(cp=cp, budget=budget, seq=lo, bytes=seen.get(lo, 0), tried=len(seen),
                seconds=time.perf_counter() - t0, params=sum(p.nbytes for p in model.parameters()))


def _formula(method: str, cp: int, kv: int) -> int:
    dkv = kv  # fp32 inputs: dK/dV are as large as K/V
    if method == "alltoall":
        return (cp - 1) * kv + (cp - 1) * kv + cp * dkv if cp > 1 else 0
    return (cp - 1) * (2 * kv + dkv)


def run(quick: bool) -> None:
    seq, rounds = (1024, 3) if quick else (4096, 5)
    res = {cp: run_distributed(_worker, seq, rounds, world_size=cp, timeout=3600)[0] for cp in (1, 2, 4)}
    base = res[1]["saved"]
    print_table(f"Attention activations per rank (causal, seq {seq})", ["cp", "saved", "cp x saved / saved(cp=1)"],
                [(cp, human_bytes(r["saved"]), f"{cp * r['saved'] / base:.3f}") for cp, r in res.items()],
                notes=f"torch SDPA on one process saves {human_bytes(res[1]['saved_sdpa'])}.")
    rows = []
    for cp, r in res.items():
        for method in ("alltoall", "allgather"):
            m = r[method]
            f = _formula(method, cp, m["kv"])
            rows.append((cp, method, human_bytes(m["bytes"]), human_bytes(f), ratio(m["bytes"], f) if f else "-",
                         f"{100 * m['exposed']:.0f}%", f"{m['time'] * 1e3:.1f} ms",
                         ratio(m["time"], res[1]["sdpa_time"])))
    print_table(f"Ring attention per call, forward + backward (seq {seq} over cp ranks)",
                ["cp", "method", "sent/rank", "formula", "sent/formula", "exposed comm", "time", "time / 1-proc SDPA"],
                rows, notes=f"1-process torch SDPA (fused CPU kernel): {res[1]['sdpa_time'] * 1e3:.1f} ms. "
                            f"torch context_parallel on CPU, cp 2: {res[2]['torch']}")
    budget_seq, layers = (256, 1) if quick else (1024, 2)  # 8 ranks share the CPUs: keep --quick small
    one = run_distributed(_longest_worker, None, budget_seq, layers, world_size=1, timeout=3600)[0]
    eight = run_distributed(_longest_worker, one["budget"], budget_seq, layers, world_size=8, timeout=3600)[0]
    print_table(f"Longest global sequence within {human_bytes(one['budget'])} of saved activations + parameters "
                f"per rank (the bytes of cp 1 at seq {budget_seq})",
                ["cp", "longest seq", "bytes/rank there", "seq / seq(cp=1)", "candidates", "search time"],
                [(r["cp"], r["seq"], human_bytes(r["bytes"]), ratio(r["seq"], one["seq"]), r["tried"],
                  f"{r['seconds']:.1f} s") for r in (one, eight)],
                notes=f"Llama-style blocks: {layers} (RMSNorm, GQA {HQ}/{HKV} heads of {SD}, SwiGLU {DIM}->{HID}; "
                      f"parameters {human_bytes(one['params'])}/rank), ring attention by alltoall, load-balanced "
                      f"causal shards; one forward + backward per candidate; ideal ratio 8.")
