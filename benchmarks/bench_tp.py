"""Tensor + sequence parallel on the Llama "8m" config: plait.tensor.parallel against
torch.distributed.tensor.parallel, the same plan (plait.models.llama.tp_plan, translated
style by style), in the same processes.

    step time     forward, loss (loss_parallel: logits stay Shard(-1)), backward, AdamW
                  step; a sample is the slowest rank's time for one step, alternating
                  plait and torch; median of the samples, plait / torch
    collectives   one step counted (plait's CommDebugMode; torch's CommDebugMode, plus the
                  payload of each op it sees): ops per step, and the "block-sized" ones
                  (payload = s*b*h fp32, the full activation) against Megatron's count:
                  TP 4 all-reduces per layer + 2 (embedding all-reduce fwd, output input
                  grad bwd), TP+SP 4 all-gathers + 4 reduce-scatters per layer + 4
                  (embedding and output, forward and backward). Payload = the larger of an op's input and
                  output (the full tensor of a gather or scatter), the same rule for both
    activations   bytes one block saves for backward on a rank (saved_tensors_hooks, each
                  storage counted once, parameters and buffers excluded), TP and TP+SP,
                  against Megatron's per-layer formulas (Korthikanti et al. 2022) written for
                  2-byte activations: TP  sbh(10 + 24/t) + 5as^2b/t,  TP+SP  sbh(34/t) +
                  5as^2b/t. This model saves fp32 (x2 bytes), has no dropout (Megatron
                  counts 1-byte masks) and a SwiGLU MLP of 2.75h (not GeLU 4h), and CPU SDPA
                  keeps no (a, s, s) scores; so the ratio to the formula is not 1, and the
                  SP / TP ratio is the figure to compare with the formula's (34/t) / (10 + 24/t)

TP degrees 2 and 4 on Gloo, one thread per rank (plait.testing's pool).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from benchmarks.common import human_bytes, median, print_table, ratio, slowest_rank_time
from plait import comm
from plait.debug import CommDebugMode
from plait.device_mesh import init_device_mesh
from plait.models.llama import CONFIGS, Transformer, parallelize_llama, tp_plan
from plait.tensor import parallel as ptp
from plait.testing import run_distributed

CONFIG = "8m"


def _build(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(CONFIGS[CONFIG])
    model.init_weights(seed=seed)
    return model


def _torch_placement(p):
    import torch.distributed.tensor as tt

    if p is None:
        return None
    if type(p).__name__ == "Shard":
        return tt.Shard(p.dim)
    assert type(p).__name__ == "Replicate", p
    return tt.Replicate()


def _torch_plan(sp: bool) -> dict:
    """plait's tp_plan, each style rebuilt as torch's with the same layouts."""
    import torch.distributed.tensor.parallel as ttp

    def tup(layouts):
        return tuple(_torch_placement(p) for p in layouts)

    plan = {}
    for fqn, style in tp_plan(sequence_parallel=sp).items():
        if isinstance(style, (ptp.ColwiseParallel, ptp.RowwiseParallel)):
            cls = ttp.ColwiseParallel if isinstance(style, ptp.ColwiseParallel) else ttp.RowwiseParallel
            plan[fqn] = cls(input_layouts=_torch_placement(style.input_layouts[0]),
                            output_layouts=_torch_placement(style.output_layouts[0]),
                            use_local_output=style.use_local_output)
        elif isinstance(style, ptp.SequenceParallel):
            plan[fqn] = ttp.SequenceParallel(sequence_dim=style.sequence_sharding[0].dim,
                                             use_local_output=style.use_local_output)
        elif isinstance(style, ptp.PrepareModuleInput):
            plan[fqn] = ttp.PrepareModuleInput(input_layouts=tup(style.input_layouts),
                                               desired_input_layouts=tup(style.desired_input_layouts),
                                               use_local_output=style.use_local_output)
        else:
            raise AssertionError(f"no torch translation for {style!r}")
    return plan


def _models(meshes, sp: bool) -> dict:
    import torch.distributed.tensor.parallel as ttp

    plait_model = parallelize_llama(_build(), meshes["plait"], sequence_parallel=sp)
    torch_model = ttp.parallelize_module(_build(), meshes["torch"], _torch_plan(sp))
    return {"plait": plait_model, "torch": torch_model}


def _loss_parallel(lib: str):
    if lib == "plait":
        return ptp.loss_parallel()
    import torch.distributed.tensor.parallel as ttp

    return ttp.loss_parallel()


def _step_fn(lib: str, model, tokens: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        logits = model(tokens[:, :-1])
        with _loss_parallel(lib):
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _payload(shapes, dtypes) -> int:
    return max((math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)), default=0)


def _torch_mode_cls():
    """torch's CommDebugMode, also noting each collective's payload (bytes)."""
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    class Counting(TorchCommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.payloads: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = sum(self.comm_counts.values())
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented and sum(self.comm_counts.values()) > before:  # torch counted one
                tensors = [t for t in (*args, out) if isinstance(t, torch.Tensor)]
                self.payloads.append(max(t.numel() * t.element_size() for t in tensors))
            return out

    return Counting


def _count_step(lib: str, step, sbh_bytes: int) -> dict:
    if lib == "plait":
        with CommDebugMode() as mode:
            step()
        payloads = [_payload(e.input_shapes + e.output_shapes, e.input_dtypes + e.output_dtypes)
                    for e in mode.events]
        ops = {k: v for k, v in mode.get_comm_counts().items()}
    else:
        with _torch_mode_cls()() as mode:
            step()
        payloads = mode.payloads
        ops = {}
        for op, n in mode.get_comm_counts().items():
            if n:
                name = str(op).split(".")[-1].removesuffix("_").replace("_into_tensor", "").replace("_tensor", "")
                ops[name] = ops.get(name, 0) + n
    big = [p for p in payloads if p == sbh_bytes]
    return {"total": len(payloads), "ops": ops, "big": len(big), "bytes": sum(payloads)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding `t`'s data on this rank (plait's or torch's DTensor, torch's
    AsyncCollectiveTensor)."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        if inner is None and type(t).__name__ == "AsyncCollectiveTensor":
            inner = t.elem
        if inner is None:
            return t
        t = inner


def _saved_bytes(model, block_input: torch.Tensor) -> int:
    """Bytes one block's forward saves for backward on this rank (unique storages,
    parameters and buffers excluded)."""
    block = model.layers["0"]
    skip = {_local(t).untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    x = block_input.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, model.rope_cache)
    del out
    return sum(seen.values())


def _worker(quick: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    group = comm.world_group()
    t = comm.get_world_size(group)
    meshes = {"plait": init_device_mesh("cpu", (t,)), "torch": torch_mesh("cpu", (t,))}
    args = CONFIGS[CONFIG]
    b, s = (2, 64) if quick else (4, 128)
    h, a = args.dim, args.n_heads
    sbh = s * b * h * 4  # fp32
    tokens = torch.randint(args.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    out: dict = {"time": {}, "counts": {}, "saved": {}, "shape": (b, s, h, a)}
    for sp in (False, True):
        models = _models(meshes, sp)
        steps = {lib: _step_fn(lib, m, tokens) for lib, m in models.items()}
        samples: dict[str, list[float]] = {"plait": [], "torch": []}
        for rep in range(1 + (3 if quick else 10)):
            for lib, step in steps.items():
                sample = slowest_rank_time(step, group)
                if rep:  # the first step builds caches and optimizer state
                    samples[lib].append(sample)
        out["time"][sp] = {lib: median(v) for lib, v in samples.items()}
        out["counts"][sp] = {lib: _count_step(lib, step, sbh) for lib, step in steps.items()}
        x = torch.randn(b, s // t if sp else s, h, generator=torch.Generator().manual_seed(1))
        out["saved"][sp] = {lib: _saved_bytes(m, x) for lib, m in models.items()}
    return out


def _megatron_big(sp: bool, layers: int) -> int:
    """Megatron's activation-sized collectives per step: per layer TP 2 all-reduces forward
    and 2 backward; TP+SP 2 all-gathers + 2 reduce-scatters forward and the reverse in
    backward; plus the embedding's (TP: all-reduce; SP: reduce-scatter, then all-gather in
    backward) and the output's input (TP: all-reduce in backward; SP: all-gather, then
    reduce-scatter in backward)."""
    return 8 * layers + 4 if sp else 4 * layers + 2


def _formula_bytes(sp: bool, t: int, b: int, s: int, h: int, a: int) -> float:
    """Megatron's per-layer activation bytes (2-byte activations), scores term included."""
    scores = 5 * a * s * s * b / t
    return s * b * h * (34 / t) + scores if sp else s * b * h * (10 + 24 / t) + scores


def run(quick: bool) -> None:
    results = {t: run_distributed(_worker, quick, world_size=t, timeout=3600)[0] for t in (2, 4)}
    layers = CONFIGS[CONFIG].n_layers
    mode = {False: "TP", True: "TP+SP"}
    rows = []
    for t, r in results.items():
        for sp in (False, True):
            p, q = r["time"][sp]["plait"], r["time"][sp]["torch"]
            rows.append((t, mode[sp], f"{p * 1e3:.0f}", f"{q * 1e3:.0f}", ratio(p, q)))
    b, s, h, a = results[2]["shape"]
    print_table(f"Llama {CONFIG} ({CONFIGS[CONFIG].num_params():,} params), b={b} s={s}: median step ms (slowest rank)",
                ["tp", "mode", "plait ms", "torch ms", "plait/torch"], rows,
                notes="Goal: plait/torch <= 1.0. Forward + loss_parallel cross-entropy + backward + AdamW.")
    rows = []
    for t, r in results.items():
        for sp in (False, True):
            c = r["counts"][sp]
            fmt = lambda ops: ", ".join(f"{n} {op}" for op, n in sorted(ops.items()))  # noqa: E731
            rows.append((t, mode[sp], c["plait"]["total"], c["torch"]["total"], c["plait"]["big"], c["torch"]["big"],
                         _megatron_big(sp, layers), human_bytes(c["plait"]["bytes"]), human_bytes(c["torch"]["bytes"]),
                         fmt(c["plait"]["ops"]), fmt(c["torch"]["ops"])))
    print_table("Collectives per training step",
                ["tp", "mode", "plait ops", "torch ops", "plait sbh-sized", "torch sbh-sized", "Megatron sbh-sized",
                 "plait payload", "torch payload", "plait by op", "torch by op"], rows,
                notes=f"sbh-sized: payload = s*b*h fp32 ({human_bytes(s * b * h * 4)}), the block boundary "
                      "collectives Megatron counts (TP 4 per layer + 2, TP+SP 8 per layer + 4, forward and "
                      "backward). The rest are small: loss_parallel's reductions over (b*s) and, under SP, the "
                      "norm weights' Partial gradients, reduced where AdamW reads them.")
    rows = []
    for t, r in results.items():
        saved = r["saved"]
        for sp in (False, True):
            formula = 2 * _formula_bytes(sp, t, b, s, h, a)  # fp32: twice Megatron's 2-byte count
            rows.append((t, mode[sp], human_bytes(saved[sp]["plait"]), human_bytes(saved[sp]["torch"]),
                         human_bytes(formula), f"{saved[sp]['plait'] / formula:.2f}"))
        sp_ratio = saved[True]["plait"] / saved[False]["plait"]
        rows.append((t, "SP / TP", f"{sp_ratio:.2f}", f"{saved[True]['torch'] / saved[False]['torch']:.2f}",
                     f"{(34 / t) / (10 + 24 / t):.2f} (no scores)", ""))
    print_table("Saved activations per layer per rank (bytes one block keeps for backward)",
                ["tp", "mode", "plait", "torch", "Megatron formula x2 (fp32)", "plait / formula"], rows,
                notes="Formula: Korthikanti et al. 2022, TP sbh(10 + 24/t) + 5as^2b/t, TP+SP 34sbh/t + 5as^2b/t, "
                      "in 2-byte activations, doubled for fp32. See the module docstring for why the model differs.")


__all__ = ["run"]
