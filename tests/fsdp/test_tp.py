"""FSDP over tensor parallel on a 2x2 (dp, tp) mesh trains like one process.

The Llama "tiny" config under its canonical plan on mesh["tp"] (TP alone and TP+SP,
untied and tied embeddings), then fully_shard per block and the root on mesh["dp"]:
every parameter is a DTensor on the (dp, tp) mesh with torch's placements: FSDP shards dim 0
of the TP-local tensor, so (_StridedShard(0, sf=2), Shard(0)) for colwise weights and the
vocab-sharded embedding / output, (Shard(0), Shard(1)) for rowwise weights, (Shard(0),
Replicate()) for SP norms (tests/fsdp/test_tp_torch_placements.py checks every parameter
against torch's fully_shard); the norms TP alone leaves plain become
Shard(0) DTensors on mesh["dp"], and one AdamW (foreach) steps on both kinds. dp rank r trains rows [2r, 2r+2) of a
global batch of 4 sequences; the single-process reference trains all 4. The mean of the
two dp losses is the reference's loss (equal halves), every step.

Tolerances are those of tests/models/test_llama_tp.py's fp32 parity (TP alone already
reorders every contraction; FSDP adds only an average of two dp halves in another
order): loss atol 1e-6 / rtol 1e-5 every step; parameters after 4 AdamW steps of lr
1e-2 every element within 1e-3 (a tenth of what one step can move a weight), 95% within
atol 1e-5 / rtol 1e-4. Four steps, not ten: each step runs the same code once AdamW has
state (from step 2), and the bounds were set for ten steps' accumulated reordering. A dp piece gathered into the wrong place, a grad not averaged
over dp or a Partial grad not reduced over tp moves most elements by O(lr).
"""


import pytest
import torch
import torch.nn.functional as F

from plait import comm
from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.models.llama import parallelize_llama
from plait.tensor import DTensor, Replicate, Shard, _StridedShard
from plait.testing import distributed
from tests.models.test_llama_tp import FP32, assert_params_match, build, full, lm_loss, tokens

STEPS = 4


def _fsdp_tp(mesh, *, sp: bool, tie: bool, seed: int = 0):
    model = parallelize_llama(build("tiny", tie=tie, seed=seed), mesh["tp"], sequence_parallel=sp)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _train(model, dp_rank: int | None, steps: int = STEPS, clip: float | None = None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    losses, norms = [], []
    for step in range(steps):
        tok = tokens(step, 4, model.args.vocab_size)
        if dp_rank is not None:
            tok = tok[2 * dp_rank:2 * dp_rank + 2]
        loss = lm_loss(model(tok[:, :-1]), tok)
        loss.backward()
        if clip is not None:
            norms.append(float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))))
        opt.step()
        opt.zero_grad()
        losses.append(float(full(loss.detach())))
    return torch.tensor(losses), torch.tensor(norms)


def _dp_mean(t: torch.Tensor, mesh) -> torch.Tensor:
    t = t.clone()
    comm.all_reduce(t, group=mesh["dp"].get_group(), op="avg")
    return t


@distributed([4], timeout=400)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_fsdp_over_tp_trains_like_one_process(sp, tie):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model, ref = _fsdp_tp(mesh, sp=sp, tie=tie), build("tiny", tie=tie)
    attn = model.layers["0"].attention
    assert attn.wq.weight.placements == (_StridedShard(0, split_factor=2), Shard(0))  # colwise
    assert attn.wo.weight.placements == (Shard(0), Shard(1))  # rowwise
    norm = model.layers["0"].ffn_norm.weight  # SequenceParallel makes it a Replicate DTensor on tp
    assert norm.placements == ((Shard(0), Replicate()) if sp else (Shard(0),)), norm.placements
    assert attn.wq.weight.device_mesh.mesh_dim_names == ("dp", "tp")
    if tie:
        assert model.output.weight is model.tok_embeddings.weight
    assert_params_match(model, ref, dict(FP32, bound=dict(atol=0, rtol=0), outliers=0), "after sharding")
    got, _ = _train(model, dp_rank)
    want, _ = _train(ref, None)
    torch.testing.assert_close(_dp_mean(got, mesh), want, **FP32["loss"])
    assert_params_match(model, ref, dict(FP32, bound=dict(atol=1e-3, rtol=1e-4)), f"after {STEPS} AdamW steps")


@distributed([4], timeout=400)
def test_fsdp_over_tp_state_dict_round_trip_and_clip_grad_norm():
    """state_dict: 2-D DTensors under the original names whose full_tensor() is the
    reference's; a fresh FSDP+TP model loads it (copying) and equals the first; clipping
    (max norm 0.5, below the gradients' norm so it always clips) gives the reference's
    total norm every step (rtol 1e-5: the norm sums squares over dp and tp pieces in
    another order) and the training still matches."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model, ref = _fsdp_tp(mesh, sp=True, tie=False), build("tiny")
    got, got_norms = _train(model, dp_rank, steps=4, clip=0.5)
    want, want_norms = _train(ref, None, steps=4, clip=0.5)
    torch.testing.assert_close(_dp_mean(got, mesh), want, **FP32["loss"])
    torch.testing.assert_close(got_norms, want_norms, rtol=1e-5, atol=1e-6)
    assert (want_norms > 0.5).all(), want_norms

    sd = model.state_dict()
    ref_sd = ref.state_dict()
    assert set(sd) == set(ref_sd), sorted(set(sd) ^ set(ref_sd))
    for fqn, value in sd.items():
        assert isinstance(value, DTensor) and value.device_mesh.ndim == 2, fqn
        torch.testing.assert_close(value.full_tensor(), ref_sd[fqn], atol=1e-3, rtol=1e-4, msg=fqn)
    fresh = _fsdp_tp(mesh, sp=True, tie=False, seed=7)
    fresh.load_state_dict(sd)
    for (fqn, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert a.placements == b.placements, fqn
        torch.testing.assert_close(b._local_tensor, a._local_tensor, atol=0, rtol=0, msg=fqn)
    a, _ = _train(model, dp_rank, steps=2)
    b, _ = _train(fresh, dp_rank, steps=2)
    torch.testing.assert_close(b, a, atol=0, rtol=0)


@distributed([4])
def test_fsdp_over_tp_bad_meshes_are_refused_before_anything_is_sent():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_llama(build("tiny"), mesh["tp"], sequence_parallel=False)
    with pytest.raises(ValueError, match=r"'weight' of Linear is a DTensor on .*slice both from one mesh"):
        fully_shard(model.layers["0"], mesh=mesh["tp"])
    with pytest.raises(ValueError, match=r"'weight' of Linear is a DTensor on .*slice both from one mesh"):
        fully_shard(model.layers["1"], mesh=mesh)  # FSDP's axes must not hold TP's
    x = F.linear(torch.ones(1, 4), torch.ones(4, 4))  # nothing above left a collective pending
    assert x.shape == (1, 4)


@distributed([4])
def test_fsdp_over_tp_shards_dim_0_as_torch_and_shard_placement_fn_picks_another():
    """A colwise bias (TP shards its only dim) is FSDP-sharded too; shard_placement_fn keeps
    torch's meaning: its dim is the dp dim, strided where TP shards that dim as well. Uneven
    sizes (10 rows: 5 per tp rank, cut by dp into 3 + 2); values equal the nested
    torch.chunk of the global tensor."""
    from plait.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_coordinate()
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 10)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    parallelize_module(lin, mesh["tp"], ColwiseParallel())
    fully_shard(lin, mesh=mesh["dp"])
    assert lin.weight.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert lin.bias.placements == (_StridedShard(0, split_factor=2), Shard(0))
    for param, value in ((lin.weight, w), (lin.bias, b)):
        tp_piece = value.chunk(2)[t]
        dp_pieces = tp_piece.chunk(2)
        mine = dp_pieces[d] if d < len(dp_pieces) else tp_piece[:0]
        torch.testing.assert_close(param.to_local(), mine, atol=0, rtol=0)
        torch.testing.assert_close(param.full_tensor(), value, atol=0, rtol=0)
    row = torch.nn.Linear(4, 6)
    parallelize_module(row, mesh["tp"], RowwiseParallel())
    fully_shard(row, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    assert row.weight.placements == (_StridedShard(1, split_factor=2), Shard(1))
    assert row.bias.placements == (Shard(0), Replicate())
    col = torch.nn.Linear(4, 6)
    parallelize_module(col, mesh["tp"], ColwiseParallel())
    fully_shard(col, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    assert col.weight.placements == (Shard(1), Shard(0))

    # the optimizer's foreach ops run on the strided shards as they are (no collective), and
    # clip_grad_norm_ reduces their norms (all-reduces only, nothing gathered)
    from plait.debug import CommDebugMode

    lin(torch.randn(3, 6)).sum().backward()
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2, foreach=True)
    with CommDebugMode() as mode:
        opt.step()
    assert dict(mode.get_comm_counts()) == {}, mode.get_comm_counts()
    with CommDebugMode() as mode:
        torch.nn.utils.clip_grad_norm_(lin.parameters(), 1e-3, foreach=True)
    assert set(mode.get_comm_counts()) == {"all_reduce"}, mode.get_comm_counts()
