"""The Llama reference model (plait.models.llama "tiny"/"tiny3") under fully_shard per
block + root trains like one process: 4 AdamW steps, world 2 and 3.

Protocol: step t's global batch is 6 sequences (tokens from seed 100 + t), rank r trains
rows [r*6/N, (r+1)*6/N); the single-process reference trains all 6. Equal slices, so the
mean of the ranks' losses is the reference's loss, and FSDP's averaged gradient is its
gradient. World 3 runs both "tiny3" (dim 48, vocab 96, hidden 144: even pieces) and
"tiny" (dim 64, vocab 128: dim 0 of most parameters does not divide by 3, so padded).

Tolerances (fp32), as tests/models/test_llama_tp.py argues for reordered sums: loss atol
1e-6 / rtol 1e-5 every step; parameters after 4 steps every element within 1e-3 (a
tenth of what one step of lr 1e-2 can move a weight), 95% within atol 1e-5 / rtol 1e-4.
Four steps, not ten: from step 2 on every step runs the same code with AdamW state, and
the bounds were set for ten steps' accumulated reordering.
FSDP changes only the batch split (a mean of per-rank means, in another order) and the
order of the reduce-scatter's sum; a dropped, doubled or misplaced shard moves most
elements by O(lr).

bf16 (param_dtype=bfloat16, reduce_dtype=float32): the reference casts the same way (a
bfloat16 copy of the float32 masters, every block's floating inputs cast to bfloat16 as
cast_forward_inputs does, one backward per rank slice, bfloat16 grads summed in float32 in
rank order / N, float32 AdamW): the same operands in the same dtypes, so float32-sized
tolerances hold (loss rtol 1e-5; parameters as fp32): a bfloat16 reduction or step would
be off by ~1e-3.
"""

import pytest
import torch

from plait import comm
from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.models.llama import CONFIGS, Transformer
from plait.tensor import DTensor
from plait.testing import chunk_sizes, distributed
from tests.fsdp.common import slices_to_reference
from tests.models.test_llama_tp import FP32, assert_params_match, build, lm_loss, tokens

STEPS = 4
BATCH = 6
BF16 = torch.bfloat16
AFTER = dict(FP32, bound=dict(atol=1e-3, rtol=1e-4))


def shard_llama(model: Transformer, **kwargs) -> Transformer:
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _rows(rank: int, n: int) -> slice:
    per = BATCH // n
    return slice(rank * per, (rank + 1) * per)


def _mean(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    comm.all_reduce(t, group=comm.world_group(), op="avg")
    return t


def train(model, *, rows: slice | None, steps: int = STEPS) -> torch.Tensor:
    opt, losses = _opt(model), []
    for step in range(steps):
        tok = tokens(step, BATCH, model.args.vocab_size)
        tok = tok if rows is None else tok[rows]
        loss = lm_loss(model(tok[:, :-1]), tok)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return torch.tensor(losses)


@distributed([2, 3], timeout=400)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_per_block_and_root_trains_like_one_process(world_size, tie):
    rank = comm.global_rank()
    for config in ("tiny", "tiny3") if world_size == 3 else ("tiny",):
        model = shard_llama(build(config, tie=tie))
        ref = build(config, tie=tie)
        wq = model.layers["0"].attention.wq.weight
        assert isinstance(wq, DTensor) and wq._local_tensor.size(0) == chunk_sizes(wq.size(0), world_size)[rank]
        if tie:
            assert model.output.weight is model.tok_embeddings.weight
        got, want = train(model, rows=_rows(rank, world_size)), train(ref, rows=None)
        torch.testing.assert_close(_mean(got), want, **FP32["loss"], msg=lambda m, c=config: f"{c}: {m}")
        assert_params_match(model, ref, AFTER, f"{config} after {STEPS} steps")


def _bf16_reference_step(ref: Transformer, tok: torch.Tensor, n: int) -> float:
    """One reference step's forward/backward (see the module docstring): float32 grads on ref."""
    low = Transformer(ref.args)
    low.load_state_dict(ref.state_dict(), strict=False)
    low.rope_cache = ref.rope_cache.clone()
    if ref.args.tie_embeddings:
        low.output.weight = low.tok_embeddings.weight
    for p in low.parameters():
        p.data = p.data.to(BF16)

    def cast(mod, args):
        return tuple(a.to(BF16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    for block in low.layers.values():
        block.register_forward_pre_hook(cast)

    def slice_loss(r: int) -> torch.Tensor:
        part = tok[_rows(r, n)]
        return lm_loss(low(part[:, :-1]), part)

    return slices_to_reference(ref, low, slice_loss, n)


@distributed([2, 3], timeout=400)
def test_llama_bf16_mixed_precision(world_size):
    rank = comm.global_rank()
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    model, ref = shard_llama(build("tiny", tie=True), mp_policy=mp), build("tiny", tie=True)
    opt, ref_opt = _opt(model), _opt(ref)
    for step in range(STEPS):
        tok = tokens(step, BATCH, model.args.vocab_size)
        part = tok[_rows(rank, world_size)]
        loss = lm_loss(model(part[:, :-1]), part)
        assert loss.dtype == torch.float32
        loss.backward()
        ref_loss = _bf16_reference_step(ref, tok, world_size)
        for p in model.parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32  # masters and grads stay fp32
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(_mean(torch.tensor([float(loss)])).item(), ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"bf16 loss at step {step}: {m}")
    assert_params_match(model, ref, AFTER, f"bf16 after {STEPS} steps")


@distributed([2, 3], timeout=400)
def test_llama_meta_device_init_equals_normal_init(world_size):
    """Built on meta, sharded, to_empty, init_weights() (global RNG, seed 0): each rank holds
    only its pieces, and the parameters (tied embedding re-tied) equal a model built and
    initialised normally from the same seed; then it trains like one process."""
    rank = comm.global_rank()
    args = CONFIGS["tiny"].replace(tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    shard_llama(model)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    ref = Transformer(args)
    torch.manual_seed(0)
    ref.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    for name, p in model.named_parameters():
        local = p._local_tensor
        assert not p.is_meta and local.size(0) == chunk_sizes(p.size(0), world_size)[rank], name
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), name
    assert_params_match(model, ref, dict(FP32, bound=dict(atol=0, rtol=0), outliers=0), "meta init")
    torch.testing.assert_close(model.rope_cache, ref.rope_cache, atol=0, rtol=0)
    got, want = train(model, rows=_rows(rank, world_size)), train(ref, rows=None)
    torch.testing.assert_close(_mean(got), want, **FP32["loss"])
    assert_params_match(model, ref, AFTER, f"meta init, after {STEPS} steps")


@distributed([2], timeout=400)
def test_llama_compiled_blocks_train_like_eager():
    """torch.compile per block (aot_eager) before fully_shard: the same parity as eager, no
    graph break, and one graph in all: the blocks share their code and shapes, and their
    parameters are graph inputs, so dynamo compiles block 0 once and reuses that graph for
    block 1 and for every step (no recompilation although the unsharded storage is freed
    and refilled each step)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, ref = build("tiny"), build("tiny")
    for block in model.layers.values():
        block.compile(backend="aot_eager")
    shard_llama(model)
    got, want = train(model, rows=_rows(comm.global_rank(), 2)), train(ref, rows=None)
    torch.testing.assert_close(_mean(got), want, **FP32["loss"])
    assert_params_match(model, ref, AFTER, f"compiled blocks, after {STEPS} steps")
    counters = torch._dynamo.utils.counters
    breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    print(f"llama compiled blocks: graph breaks {breaks}, unique graphs {graphs}")
    assert breaks == {}, breaks
    assert graphs == 1, graphs
