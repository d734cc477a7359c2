"""The calibration's forked probe: what N ranks on this host's cores pay for a collective and for
a tensor-parallel model, measured among N processes as a job of N ranks runs them.

    N processes forked from the calibrating one (torch imported, no op run yet: fork-safe, no
    start-up to wait for), one thread each, as plait train runs N ranks here:
      in step, each computes a burst (two 256x128 @ 128x512 matmuls, ~1 ms: the small config's
      ranks compute 0.6-1.8 ms between calls) then calls an all-reduce over its group of g
      consecutive ranks, every group of that size at once, for each g dividing N (each group
      warmed up first); the variants alternate over ROUNDS rounds, the median of each taken ->
        per call (s), per g: the wall a 4-byte call adds over the bursts alone: its CPU, stretched
          by the ranks sharing a core, and the waits for its group's ranks to be scheduled
        bandwidth (bytes/s per rank), per g: a 1 MiB all-reduce's ring bytes per rank,
          2(g-1)/g * S, over the wall it adds beyond the 4-byte call
        p2p (s), the wall a stage-to-stage send or receive adds: pairs of ranks, each exchanging a
          4-byte tensor both ways between bursts (one batch_isend_irecv per transfer, as the
          pipeline runtime posts them), all pairs at once; half the wall a round adds
      dtensor_op_s: the CPU (thread time, not wall) of an add on a replicated plait DTensor over
        the N-rank mesh: plait's dispatch alone
      tp factor, per tensor-parallel degree g a layout can use and sequence parallel on/off: the
        model (its first TP_LAYERS blocks) under plait's TP plan on groups of g consecutive ranks,
        every group at once, forward + backward with the loss at the tokens a rank of tp g and
        dp N/g holds -> its wall per step over the same model's unsharded, every rank running it
        at once at the same tokens. What a TP rank's compute costs, in units of the plain
        model's: the sharded matmuls, the DTensor dispatch, the replicated elementwise work, the
        TP collectives' CPU and their waits, all as measured; and, where g < N, the same under
        replicate over the dp groups of N/g, as plait train runs R x T (DDP's take-in of
        DTensor gradients is per gradient, and its all-reduces' CPU and waits are in the step),
        and under fully_shard over them (each block, then the root), as it runs FSDP x T (FSDP's
        copy-in and copy-out on DTensors, its gathers and reductions), each measured with
        sequence parallel, its ratio to TP alone carried over to TP without it
      cp factor, per context-parallel degree c: the same for the model under plait train's
        context parallel (ring attention) and fully_shard (each block, then the root: plait train
        shards every CP layout over dp_shard x cp) on groups of c, a cp rank's tokens (c times the
        sequences, each cut to 2 of 2c chunks) over the plain model's at as many tokens (whole
        sequences: each token attends over the whole sequence either way)
      fsdp factor, per group size g: the plain model under fully_shard (each block, then the
        root) over groups of g, at the plain model's tokens, over the plain model's: FSDP's copy-in
        and copy-out, its gathers and reductions, as FSDP and HSDP layouts run them
      contention: the plain model's step (the CP factor's base) among N ranks over its CPU alone
        (timed after, in the calibrating process) times the ranks per core: what N processes on
        these cores get done per CPU second against one alone (caches, switches), at least 1

The probe stops by its budget: the forked ranks are killed past it and calibrate says so.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import time
from pathlib import Path

BURST = (256, 128, 512)  # (m, k, n): one matmul of 2mkn = 34 MFLOP, ~0.5 ms on one core of this host
BURSTS_PER_CALL = 2  # ~1 ms of compute between calls: the small config's ranks compute 0.6 (TP) to 1.8 ms (FSDP)
ROUNDS = 5  # the variants alternate, ROUNDS times
BIG = 1 << 18  # floats: the 1 MiB all-reduce that gives the bandwidth at the job's process count
TP_LAYERS = 2  # blocks of the model the TP probe runs (the factor is per unit of plain model time)
TP_TOKENS = 2048  # at most this many tokens a TP probe step (its cost grows with them)
TP_REPEATS = 2  # timed steps per variant, after one warm-up (the whole calibration: at most 30 s)


def group_sizes(nproc: int) -> list[int]:
    """The group sizes a layout of `nproc` ranks can use: every divisor above 1."""
    return [g for g in range(2, nproc + 1) if nproc % g == 0]


def tp_degrees(args, nproc: int) -> list[int]:
    """The TP degrees among `nproc` ranks the model's heads and KV heads split over."""
    return [g for g in group_sizes(nproc) if args.n_heads % g == 0 and args.kv_heads % g == 0]


def _tp_shape(args, batch: int, seq_len: int, g: int) -> tuple[int, int]:
    """(sequences, length) of the TP probe's step at degree g: a rank of tp g, dp N/g holds
    batch * g sequences (batch: the global batch over N), at most TP_TOKENS tokens."""
    s = max(g, min(seq_len, TP_TOKENS) // g * g)  # sequence parallel splits the sequence over g
    return max(1, min(batch * g, TP_TOKENS // s)), s


def cp_degrees(seq_len: int, nproc: int) -> list[int]:
    """The context-parallel degrees among `nproc` ranks whose 2 * cp chunks split the sequence."""
    return [c for c in group_sizes(nproc) if seq_len % (2 * c) == 0]


def _together(step, repeats: int = TP_REPEATS) -> float:
    """Wall seconds of one `step` with every rank at it at once, as the job's ranks run: from a
    barrier to the last rank's end (a job's next step waits for its slowest rank; a rank's own
    end alone would read short where it got the cores first, and a ratio of two such figures
    swung by 1.5x between calibrations)."""
    from plait import comm

    step()  # warm-up: plans built, buffers allocated
    world = comm.world_group()
    comm.barrier(group=world)
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    comm.barrier(group=world)
    return (time.perf_counter() - t0) / repeats


def _cp_step(cp_batch, train, m, x, y, mesh) -> None:
    with cp_batch([m], x, y, mesh=mesh) as (x_local, y_local):
        train(m, x_local, y_local)


def _replicate(model, mesh) -> None:
    from plait.ddp import replicate
    replicate(model, device_mesh=mesh)


def _sharded_factors(args, batch: int, seq_len: int, nproc: int, rank: int) -> dict[str, float]:
    """{"tp:g,sp", "tpddp:g,sp", "tpfsdp:g,sp", "cp:c" and "fsdp:g": the sharded model's wall a
    step over the plain model's at the same tokens, each with all N ranks at it}."""
    import dataclasses

    import torch

    from plait.device_mesh import init_device_mesh
    from plait.models.llama import Transformer, parallelize_llama
    from plait.train.context import cp_batch
    from plait.train.parallelize import lm_loss, shard_stage

    small = dataclasses.replace(args, n_layers=min(args.n_layers, TP_LAYERS))
    gen = torch.Generator().manual_seed(rank)

    def model() -> Transformer:
        torch.manual_seed(0)
        return Transformer(small)

    def train(m, x: torch.Tensor, y: torch.Tensor) -> None:
        lm_loss(m(x), y).backward()

    def tokens(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, args.vocab_size, (b, s + 1), generator=gen)
        return x[:, :-1], x[:, 1:]

    out = {}
    for g in tp_degrees(args, nproc):  # a tp-g rank: its dp share's sequences, whole
        x, y = tokens(*_tp_shape(args, batch, seq_len, g))
        base = _together(functools.partial(train, model(), x, y))
        mesh = init_device_mesh("cpu", (nproc // g, g), mesh_dim_names=("dp", "tp"))  # groups of g consecutive ranks
        for sp in (True, False):
            m = parallelize_llama(model(), mesh["tp"], sequence_parallel=sp, loss_parallel=True)
            out[f"tp:{g},{int(sp)}"] = _together(functools.partial(train, m, x, y)) / base
        for key, wrap in (("tpddp", _replicate), ("tpfsdp", shard_stage)) if g < nproc else ():
            # R x T, FSDP x T: plait train's data-parallel wrapper over the dp groups, its take-in
            # and collectives in the step; measured with sequence parallel, and its ratio to TP
            # alone carried to TP without it (the wrapper's work does not depend on it; the
            # probe's budget: 30 s in all)
            m = parallelize_llama(model(), mesh["tp"], sequence_parallel=True, loss_parallel=True)
            wrap(m, mesh["dp"])
            wrapped = _together(functools.partial(train, m, x, y)) / base
            out[f"{key}:{g},1"] = wrapped
            out[f"{key}:{g},0"] = out[f"tp:{g},0"] * wrapped / out[f"tp:{g},1"]
    s = seq_len
    b = max(1, min(batch, TP_TOKENS // s))
    x, y = tokens(b, s)
    base = out["plain"] = _together(functools.partial(train, model(), x, y))
    for c in cp_degrees(seq_len, nproc):  # a cp-c rank: c times the sequences, each cut to 2 of 2c chunks
        mesh = init_device_mesh("cpu", (nproc // c, c), mesh_dim_names=("dp", "cp"))
        xc, yc = tokens(b * c, s)
        m = model()
        shard_stage(m, mesh["cp"])  # plait train shards a CP layout over dp_shard x cp
        out[f"cp:{c}"] = _together(functools.partial(_cp_step, cp_batch, train, m, xc, yc, mesh["cp"])) / base
    for g in group_sizes(nproc):  # a dp_shard-g rank: the plain model under fully_shard over groups of g
        m = model()
        shard_stage(m, init_device_mesh("cpu", (nproc // g, g), mesh_dim_names=("dp", "shard"))["shard"])
        out[f"fsdp:{g}"] = _together(functools.partial(train, m, x, y)) / base
    return out


def _rank(rank: int, nproc: int, store: str, out: str, repeats: int, tp: tuple | None) -> None:
    """One of the probe's processes (forked from the calibrating one): every rank, in step,
    computes a burst and calls a collective over its group of g consecutive ranks (all groups of
    that size at once, as a layout's axis does); the extra wall time over the bursts alone, per
    call, is what a call costs among `nproc` processes on these cores. Then, with `tp` (the
    model's args, the global batch over N, the sequence length), the TP factors."""
    import torch

    from plait import comm

    torch.set_num_threads(1)  # as plait train sets it when the ranks outnumber the cores
    comm.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nproc)
    world = comm.world_group()
    sizes = group_sizes(nproc)
    groups = {g: world if g == nproc else comm.new_group(list(range(rank // g * g, rank // g * g + g)))
              for g in sizes}
    a, w = torch.randn(*BURST[:2]), torch.randn(*BURST[1:])
    small, big = a.new_zeros(1), a.new_zeros(BIG)  # 4 bytes, 1 MiB

    def loop(call) -> float:
        comm.barrier(group=world)
        t0 = time.perf_counter()
        for _ in range(repeats):
            for _ in range(BURSTS_PER_CALL):
                a @ w
            if call is not None:
                call()
        comm.barrier(group=world)  # to the last rank's end, as _together
        return (time.perf_counter() - t0) / repeats

    partner, inbox = rank ^ 1, small.clone()  # pairs (0, 1), (2, 3), ...: a rank past the last pair only computes

    def hop() -> None:
        """A stage-to-stage transfer each way, as the pipeline runtime posts them (one batch per
        transfer): the even rank sends then receives, its partner the other way round."""
        if partner >= nproc:
            return
        send, recv = [comm.P2POp("send", small, partner, world)], [comm.P2POp("recv", inbox, partner, world)]
        for ops in (send, recv) if rank % 2 == 0 else (recv, send):
            for handle in comm.batch_isend_irecv(ops):
                handle.wait()

    variants = {"bursts": None, **{f"small{g}": functools.partial(comm.all_reduce, small, group=groups[g]) for g in sizes},
                **{f"big{g}": functools.partial(comm.all_reduce, big, group=groups[g]) for g in sizes}, "p2p": hop}
    for call in variants.values():  # a group's first all-reduce sets Gloo up: 45 ms a call
        if call is not None:  # at 8 processes, 6 ms after (g8 read 10 ms in a mean over rounds)
            call()
    rounds = {key: [] for key in variants}  # each variant in every round: a change in load falls on all alike
    for key, call in [kv for _ in range(ROUNDS) for kv in variants.items()]:
        rounds[key].append(loop(call))
    found = {key: statistics.median(times) for key, times in rounds.items()}
    from plait.device_mesh import init_device_mesh
    from plait.tensor import Replicate, distribute_tensor

    d = distribute_tensor(torch.zeros(8, 8), init_device_mesh("cpu", (nproc,)), [Replicate()])
    d.add_(1.0)
    c0 = time.thread_time()  # CPU, not wall: the host cost of an op, apart from time-sharing
    for _ in range(200):
        d.add_(1.0)
    found["dtensor_op_s"] = (time.thread_time() - c0) / 200
    if tp is not None:
        found["sharded"] = _sharded_factors(*tp, nproc, rank)
    Path(out).write_text(json.dumps(found))
    comm.barrier(group=world)
    comm.destroy_process_group()


def collective_costs(nproc: int, *, budget_s: float = 15.0, repeats: int = 10, tp: tuple | None = None
                     ) -> tuple[dict[int, tuple[float, float]], float, dict[str, float], float]:
    """({group size: (seconds per call, bytes/s per rank)} among `nproc` processes on this host,
    each rank computing between calls; host seconds of one plait DTensor op; {"p2p": seconds a
    stage-to-stage send or receive adds} and, with `tp` = (args, global batch over N, sequence
    length), {"tp:g,sp" or "cp:c": factor}; the contention factor), from
    `nproc` processes forked
    from this one (torch already imported: no start-up to wait for). The figures are the mean
    over ranks; a call's cost is its extra wall time over the bursts alone, so it holds the
    call's own CPU, stretched by the ranks sharing a core, and the waits for the group's ranks to
    be scheduled."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(nproc)]
        procs = [ctx.Process(target=_rank, args=(r, nproc, os.path.join(tmp, "store"), outs[r], repeats, tp))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.perf_counter() + budget_s
        for p in procs:
            p.join(max(0.1, deadline - time.perf_counter()))
        late = [p for p in procs if p.is_alive()]
        for p in late:
            p.kill()
            p.join()
        if late or any(p.exitcode for p in procs):
            raise RuntimeError(f"plait plan --calibrate: the {nproc}-process probe did not finish in "
                               f"{budget_s:.0f} s (exit codes {[p.exitcode for p in procs]})")
        found = [json.loads(Path(o).read_text()) for o in outs]
    mean = lambda key: statistics.mean(f[key] for f in found)  # noqa: E731
    table = {}
    for g in group_sizes(nproc):
        call = max(0.0, mean(f"small{g}") - mean("bursts"))
        sent = 2 * (g - 1) / g * BIG * 4  # per rank, the ring all-reduce's count
        # the bytes' time: the big call's over the small one's, at least a tenth of the big call
        # (on a loaded host the difference of two noisy figures can come out at nothing)
        moving = max(mean(f"big{g}") - mean(f"small{g}"), 0.1 * (mean(f"big{g}") - mean("bursts")), 1e-6)
        table[g] = (call, sent / moving)
    factors = {k: statistics.mean(f["sharded"][k] for f in found) for k in found[0].get("sharded", {})}
    factors["p2p"] = max(0.0, mean("p2p") - mean("bursts")) / 2  # a send or a receive: two calls a round
    contention = 1.0
    if tp is not None:  # the plain model's step among the N ranks against this process's alone
        from plait.plan.hardware import host_cores

        alone = _plain_alone(*tp)  # after the fork: this process, alone
        contention = factors.pop("plain") / (alone * max(1.0, nproc / host_cores()))
    return table, mean("dtensor_op_s"), factors, max(1.0, contention)


def _plain_alone(args, batch: int, seq_len: int) -> float:
    """CPU seconds (thread time) of the probe's plain model step at the CP probe's shape, here."""
    import dataclasses

    import torch

    from plait.models.llama import Transformer
    from plait.train.parallelize import lm_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = Transformer(dataclasses.replace(args, n_layers=min(args.n_layers, TP_LAYERS)))
    x = torch.randint(0, args.vocab_size, (max(1, min(batch, TP_TOKENS // seq_len)), seq_len + 1))
    times = []
    for _ in range(TP_REPEATS + 1):
        t0 = time.thread_time()
        lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
        times.append(time.thread_time() - t0)
    return statistics.median(times[1:])
