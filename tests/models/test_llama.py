"""plait.models.llama on one process: its configs' sizes, shapes, causality, tying, meta
init and that it learns. Exact comparisons (rtol 0) where the same ops run on the same
numbers; the causality check allows 1e-6 because SDPA may block its reductions by the
sequence length it is given."""

import pytest
import torch
import torch.nn.functional as F

from plait.models.llama import CONFIGS, ModelArgs, Transformer


def _build(name="tiny", seed=0, **changes):
    torch.manual_seed(seed)
    model = Transformer(CONFIGS[name].replace(**changes))
    model.init_weights(seed=seed)
    return model


def test_named_configs_state_their_parameter_counts():
    counts = {"tiny": 115_008, "tiny3": 64_752, "8m": 7_999_744}
    for name, expected in counts.items():
        assert CONFIGS[name].num_params() == expected, name
        with torch.device("meta"):  # the closed form is the module's own count
            model = Transformer(CONFIGS[name])
        assert sum(p.numel() for p in model.parameters()) == expected, name
    tied = CONFIGS["tiny"].replace(tie_embeddings=True)
    assert tied.num_params() == counts["tiny"] - 128 * 64
    assert sum(p.numel() for p in Transformer(tied).parameters()) == tied.num_params()


def test_fqns_are_torchtitans():
    names = {n for n, _ in Transformer(CONFIGS["tiny"]).named_parameters()}
    assert {"tok_embeddings.weight", "norm.weight", "output.weight"} <= names
    for i in range(2):
        for sub in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "attention_norm",
                    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "ffn_norm"):
            assert f"layers.{i}.{sub}.weight" in names
    model = Transformer(CONFIGS["tiny"])
    assert "rope_cache" not in model.state_dict(), "the rotary table is not persistent"
    assert isinstance(model.layers, torch.nn.ModuleDict)


@pytest.mark.parametrize("name", ["tiny", "tiny3"])
def test_shapes(name):
    model = _build(name)
    a = model.args
    tokens = torch.randint(a.vocab_size, (3, 17))
    assert model(tokens).shape == (3, 17, a.vocab_size)
    b = next(iter(model.layers.values()))
    assert b.attention.wk.weight.shape == (a.kv_heads * a.head_dim, a.dim)
    assert b.feed_forward.w1.weight.shape == (a.ffn_hidden_dim(), a.dim)


def test_output_at_t_ignores_later_tokens():
    model = _build()
    tokens = torch.randint(128, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 128
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3, "later positions must see the change"


def test_tied_output_shares_one_parameter():
    model = _build(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    params = list(model.parameters())
    assert sum(p is model.output.weight for p in params) == 1
    F.cross_entropy(model(torch.randint(128, (2, 8))).flatten(0, 1), torch.randint(128, (16,))).backward()
    assert model.tok_embeddings.weight.grad is not None


@pytest.mark.parametrize("tie", [False, True])
def test_meta_init_equals_cpu_init(tie):
    args = CONFIGS["tiny"].replace(tie_embeddings=tie)
    torch.manual_seed(0)
    cpu = Transformer(args)
    torch.manual_seed(5)
    cpu.init_weights()
    with torch.device("meta"):
        meta = Transformer(args)
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.init_weights()
    if tie:
        assert meta.output.weight is meta.tok_embeddings.weight
    for (n, p), (_, q) in zip(cpu.named_parameters(), meta.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    torch.testing.assert_close(cpu.rope_cache, meta.rope_cache, rtol=0, atol=0)
    # seed= ignores the global RNG
    cpu.init_weights(seed=3)
    torch.manual_seed(99)
    meta.init_weights(seed=3)
    for (n, p), (_, q) in zip(cpu.named_parameters(), meta.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_pipeline_stage_without_embeddings_norm_or_output():
    model = _build()
    tokens = torch.randint(128, (2, 8))
    full = model(tokens)
    first = _build()
    first.norm = first.output = None
    del first.layers["1"]
    last = _build()
    last.tok_embeddings = None
    del last.layers["0"]
    torch.testing.assert_close(last(first(tokens)), full, rtol=0, atol=0)
    assert "layers.1.attention.wq.weight" in dict(last.named_parameters())


def test_a_few_adamw_steps_reduce_the_loss():
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(128, (4, 33), generator=gen)
    losses = []
    for _ in range(8):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_bf16_forward():
    model = _build().to(torch.bfloat16)
    out = model(torch.randint(128, (2, 8)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_bad_args_name_the_numbers():
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be divisible by n_kv_heads \(4\)"):
        ModelArgs(dim=48, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"dim \(50\) must be divisible by n_heads \(4\)"):
        ModelArgs(dim=50, n_heads=4)
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        _build()(torch.zeros(1, 65, dtype=torch.long))
