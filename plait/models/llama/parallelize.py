"""The Llama decoder's canonical tensor-parallel plan (torch's and torchtitan's), and the
one call that applies it.

    TP+SP (sequence_parallel=True), residual stream h: (b, s/tp, dim) local tensors
      tok_embeddings  RowwiseParallel(input Replicate, output Shard(1))  vocab rows; reduce-scatter
      attention_norm  SequenceParallel()                                 h as Shard(1)
      attention       PrepareModuleInput(Shard(1) -> Replicate)          one all-gather
      wq, wk, wv      ColwiseParallel()                                  local heads out
      wo              RowwiseParallel(output Shard(1))                   one reduce-scatter
      ffn_norm, feed_forward, w1/w3, w2                                  the same pattern
      norm            SequenceParallel()
      output          ColwiseParallel(input Shard(1), output Shard(-1))  logits sharded on vocab,
                                                                         for loss_parallel()
    TP alone: h is (b, s, dim) replicated; norms stay plain modules; each region takes one
      Replicate DTensor (so its colwise gradients add up before one all-reduce) and wo/w2
      all-reduce; tok_embeddings all-reduces into Replicate.

So a block communicates as Megatron's: TP, one all-reduce after attention and one after
the MLP in forward, the matching two in backward; TP+SP, an all-gather before and a
reduce-scatter after each region instead. The second input of attention (the rotary
table) is left alone: it is a plain buffer every rank holds whole.
"""

from __future__ import annotations

from plait.device_mesh import DeviceMesh
from plait.models.llama.model import Transformer
from plait.tensor import Replicate, Shard
from plait.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The plan for `parallelize_module(model, mesh["tp"], plan)`, FQN patterns over all layers.

    With `loss_parallel`, the logits stay a DTensor sharded on the vocabulary (Shard(-1)):
    compute the loss inside `plait.tensor.parallel.loss_parallel()`. Without it they are
    gathered and returned as a plain (b, s, vocab) tensor on every rank.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    logits = dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else \
        dict(output_layouts=Replicate(), use_local_output=True)
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, **logits),
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        plan["layers.*.attention_norm"] = SequenceParallel()
        plan["layers.*.ffn_norm"] = SequenceParallel()
    return plan


def check_tp_degree(model: Transformer, tp: int) -> None:
    """Raise (before anything is sent) if a block's heads or KV heads do not split over tp.

    The counts are read from the weights (wq's rows / head_dim), as the forward reads them.
    """
    for name, layer in model.layers.items():
        attn = layer.attention
        for what, w in (("n_heads", attn.wq), ("n_kv_heads", attn.wk)):
            heads = w.weight.shape[0] // attn.head_dim
            if heads % tp:
                raise ValueError(
                    f"layers.{name}.attention has {what} = {heads} ({type(w).__name__} "
                    f"{'wq' if w is attn.wq else 'wk'} of {w.weight.shape[0]} rows / head_dim "
                    f"{attn.head_dim}), not divisible by the tensor-parallel degree {tp}: "
                    f"choose a tp degree that divides {heads}, or another config")


def parallelize_llama(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                      loss_parallel: bool = True) -> Transformer:
    """Apply `tp_plan` to `model` on the 1-D `tp_mesh`, in place; returns `model`.

    Beyond `parallelize_module(model, tp_mesh, tp_plan(...))`: the head counts are checked
    first, plan entries for modules a pipeline stage lacks (tok_embeddings, norm, output
    set to None) are dropped, and tied embeddings are tied again (each style makes its
    own DTensor parameter; the embedding's rows and the output's rows are both Shard(0),
    so one parameter serves both).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"parallelize_llama takes the 1-D tensor-parallel mesh, got shape {tuple(tp_mesh.shape)}; "
                         "pass mesh['tp']")
    check_tp_degree(model, tp_mesh.size())
    plan = tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    for top in ("tok_embeddings", "norm", "output"):
        if getattr(model, top) is None:
            plan.pop(top, None)
    if not model.layers:
        plan = {k: v for k, v in plan.items() if not k.startswith("layers.")}
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.output.weight = model.tok_embeddings.weight
    return model

