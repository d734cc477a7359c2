"""loss_parallel: F.cross_entropy (and F.nll_loss after F.log_softmax) on logits sharded
along the class dim equals plain cross-entropy on the whole logits, value and gradient,
with every option of F.cross_entropy: reduction mean / sum / none, ignore_index (some
targets ignored), label_smoothing, class weights, probability targets; inputs (N, C),
(C,) and (N, C, d); vocabularies 7 and 5, which split unevenly (5 on 4 ranks: 2, 2, 1, 0,
a rank with no classes), on 1 to 4 ranks. The logits are never gathered: forward issues
only all-reduces of per-sample values (max, sum of exp, the picked terms), backward of
cross_entropy none at all (log_softmax alone: one, of the per-sample grad sum).

Tolerance 1e-5 (float32): the log-sum-exp adds the same terms in another order.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from plait.tensor.parallel import loss_parallel
from plait.testing import distributed

TOL = dict(atol=1e-5, rtol=1e-5)
IGNORE = 2


def _case(shape, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, generator=g) * 3
    class_dim = 1 if len(shape) >= 2 else 0
    tshape = shape[:class_dim] + shape[class_dim + 1:]
    target = torch.randint(0, shape[class_dim], tshape, generator=g)
    if ignore and target.numel() > 1:
        target.view(-1)[::3] = IGNORE  # some targets are the ignored class
    weight = torch.rand(shape[class_dim], generator=g) + 0.5
    return logits, target, weight, class_dim


def _compare(mesh, logits, class_dim, fn, backward_collectives=0):
    ref = logits.clone().requires_grad_()
    want = fn(ref)
    want.sum().backward()
    x = distribute_tensor(logits, mesh, [Shard(class_dim)]).requires_grad_()
    with CommDebugMode() as fwd, loss_parallel():
        got = fn(x)
    assert isinstance(got, DTensor) and got.placements == (Replicate(),)
    assert set(fwd.get_comm_counts()) <= {"all_reduce"}, fwd.get_comm_counts()
    with CommDebugMode() as bwd:
        got.sum().backward()
    assert bwd.get_total_counts() == backward_collectives, bwd.get_comm_counts()
    torch.testing.assert_close(got.full_tensor(), want.detach(), **TOL)
    assert x.grad.placements == (Shard(class_dim),)
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad, **TOL)


OPTIONS = list(itertools.product(["mean", "sum", "none"], [-100, IGNORE], [0.0, 0.1], [False, True]))


@distributed([1, 2, 3, 4])
@pytest.mark.parametrize("vocab", [7, 5])
def test_cross_entropy_every_option(world_size, vocab):
    mesh = init_device_mesh("cpu", (world_size,))
    logits, target, weight, class_dim = _case((6, vocab))
    for reduction, ignore_index, smoothing, weighted in OPTIONS:
        kwargs = dict(weight=weight if weighted else None, ignore_index=ignore_index, reduction=reduction,
                      label_smoothing=smoothing)
        _compare(mesh, logits, class_dim, lambda x, kw=kwargs: F.cross_entropy(x, target, **kw))


@distributed([1, 3, 4])
def test_cross_entropy_shapes_and_probability_targets(world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    for shape in [(7,), (3, 7, 2)]:  # one sample; a spatial dim after the classes
        logits, target, weight, class_dim = _case(shape, seed=1)
        for reduction, smoothing in itertools.product(["mean", "sum", "none"], [0.0, 0.2]):
            _compare(mesh, logits, class_dim, lambda x, r=reduction, s=smoothing, t=target, w=weight: F.cross_entropy(
                x, t, weight=w, ignore_index=IGNORE, reduction=r, label_smoothing=s))
    logits, _, weight, class_dim = _case((5, 7), seed=2)
    probs = torch.softmax(torch.randn(5, 7, generator=torch.Generator().manual_seed(3)), -1)
    for reduction, smoothing, weighted in itertools.product(["mean", "sum", "none"], [0.0, 0.1], [False, True]):
        _compare(mesh, logits, class_dim, lambda x, r=reduction, s=smoothing, w=weighted: F.cross_entropy(
            x, probs, weight=weight if w else None, reduction=r, label_smoothing=s))


@distributed([2, 3])
def test_log_softmax_then_nll_loss_and_module_api(world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    logits, target, weight, class_dim = _case((6, 7), seed=4)
    for reduction, weighted in itertools.product(["mean", "sum", "none"], [False, True]):
        _compare(mesh, logits, class_dim, lambda x, r=reduction, w=weighted: F.nll_loss(
            F.log_softmax(x, dim=-1), target, weight=weight if w else None, ignore_index=IGNORE, reduction=r),
            backward_collectives=1)  # log_softmax's backward sums the grad over the classes
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE, label_smoothing=0.05)
    _compare(mesh, logits, class_dim, lambda x: loss_fn(x, target))
    # (B, S, V) logits sharded on the vocabulary, flattened as a language model does
    lm = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(5))
    labels = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(6))
    ref = lm.clone().requires_grad_()
    F.cross_entropy(ref.flatten(0, 1), labels.flatten()).backward()
    x = distribute_tensor(lm, mesh, [Shard(-1)]).requires_grad_()
    with CommDebugMode() as mode, loss_parallel():
        loss = F.cross_entropy(x.flatten(0, 1), labels.flatten())
        loss.backward()
    assert set(mode.get_comm_counts()) == {"all_reduce"}
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad, **TOL)


@distributed([2])
def test_bf16_and_errors():
    mesh = init_device_mesh("cpu", (2,))
    logits, target, weight, _ = _case((6, 7), seed=7)
    x = distribute_tensor(logits.bfloat16(), mesh, [Shard(1)]).requires_grad_()
    ref = logits.bfloat16().requires_grad_()
    want = F.cross_entropy(ref, target, label_smoothing=0.1)
    want.backward()
    with loss_parallel():
        got = F.cross_entropy(x, target, label_smoothing=0.1)
        got.backward()
    assert got.dtype == torch.bfloat16
    # bf16: the reference rounds log_softmax to bf16 per element, plait sums in fp32
    torch.testing.assert_close(got.full_tensor(), want.detach(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad, atol=1e-2, rtol=3e-2)
    with loss_parallel():
        with pytest.raises(ValueError, match="class dim 1"):
            F.cross_entropy(distribute_tensor(logits, mesh, [Shard(0)]), target)
        with pytest.raises(ValueError, match="target has shape"):
            F.cross_entropy(distribute_tensor(logits, mesh, [Shard(1)]), target[:3])
        with pytest.raises(ValueError, match="weight has shape"):
            F.cross_entropy(distribute_tensor(logits, mesh, [Shard(1)]), target, weight=weight[:3])
        # plain tensors are untouched by the context
        torch.testing.assert_close(F.cross_entropy(logits, target), F.cross_entropy(logits.clone(), target))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        return self.output(self.norm(self.tok_embeddings(ids)))


@distributed([2, 3])
def test_vocab_parallel_language_model_head(world_size):
    """The Llama pattern: embedding rowwise into Shard(1), a SequenceParallel norm, the
    output colwise kept as a Shard(-1) DTensor, and loss_parallel on it (vocab 11: uneven)."""
    from plait.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ref = TinyLM()
    torch.manual_seed(0)
    model = parallelize_module(TinyLM(), mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    })
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 11, (2, 6), generator=g), torch.randint(0, 11, (2, 6), generator=g)
    want = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), label_smoothing=0.1)
    want.backward()
    with loss_parallel():
        logits = model(ids)
        assert logits.placements == (Shard(2),)
        got = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1)
        got.backward()
    torch.testing.assert_close(got.full_tensor(), want.detach(), **TOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
