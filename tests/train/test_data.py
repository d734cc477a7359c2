"""The trainer's data: the standard library corpus, tokenizers, windows, and a global batch
stream that resumes with another data-parallel degree without repeating or skipping a sample."""

from __future__ import annotations

import pytest
import torch

from plait.data.text import (
    ByteTokenizer,
    TokenWindows,
    build_corpus,
    corpus_files,
    iter_corpus_files,
    read_corpus,
    stdlib_dir,
)
from plait.train.data import BatchStream


def test_corpus_is_the_stdlib_in_a_fixed_order():
    files = corpus_files()
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    rel = [f.relative_to(stdlib_dir()).as_posix() for f in files]
    assert rel == sorted(rel) and "os.py" in rel
    text = read_corpus(files, max_bytes=10_000)
    assert len(text) == 10_000 and text == read_corpus(corpus_files(), max_bytes=10_000)


def test_corpus_is_walked_in_the_order_of_its_sorted_relative_paths(tmp_path):
    """The walk yields files in sorted order without listing the whole tree first: names that
    sort around a folder's "/" ("a-b" < "a/" < "a0"), pruned and linked folders, a name glob."""
    for name in ("a-b.py", "a/x.py", "a/b/y.py", "a0.py", "a.py", "b/__pycache__/c.py", "b/site-packages/d.py",
                 "b/e.txt", "A/z.py", "a b/w.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "link").symlink_to(tmp_path / "a")  # a linked folder is not followed (as os.walk)
    rel = [f.relative_to(tmp_path).as_posix() for f in corpus_files(tmp_path)]
    assert rel == ["A/z.py", "a b/w.py", "a-b.py", "a.py", "a/b/y.py", "a/x.py", "a0.py"] == sorted(rel)
    assert [f.name for f in corpus_files(tmp_path, glob="*.py")] == ["a-b.py", "a.py", "a0.py"]
    assert read_corpus(iter_corpus_files(tmp_path), max_bytes=12) == b"A/z.py\n\na b/"
    with pytest.raises(ValueError, match=r"no files matching '\*\*/\*.rs'"):
        build_corpus(path=str(tmp_path), glob="**/*.rs")


def test_byte_tokenizer_round_trips_and_windows_split_without_overlap():
    tokens, tok = build_corpus(max_bytes=20_000)
    assert isinstance(tok, ByteTokenizer) and tokens.max() < 256
    assert tok.decode(tokens[:200]) == read_corpus(corpus_files(), max_bytes=200).decode()
    train = TokenWindows(tokens, seq_len=32, split="train", val_fraction=0.1)
    val = TokenWindows(tokens, seq_len=32, split="val", val_fraction=0.1)
    assert len(train) + len(val) == (tokens.numel() - 1) // 32
    assert set(train.index.tolist()).isdisjoint(val.index.tolist())
    w = train[3]
    start = int(train.index[3]) * 32
    assert w.shape == (33,) and torch.equal(w, tokens[start : start + 33])


def test_bpe_tokenizer_is_trained_once_and_cached(tmp_path):
    pytest.importorskip("tokenizers")
    tokens, tok = build_corpus(max_bytes=200_000, tokenizer="bpe", vocab_size=400, cache_dir=tmp_path)
    (cached,) = tmp_path.glob("bpe-400-*.json")
    again, tok2 = build_corpus(max_bytes=200_000, tokenizer="bpe", vocab_size=400, cache_dir=tmp_path)
    assert torch.equal(tokens, again) and tokens.max() < 400 and tokens.numel() < 200_000 / 1.5
    assert tok2.decode(tokens[:50]) == tok.decode(tokens[:50])
    assert read_corpus(corpus_files(), max_bytes=200_000).decode().startswith(tok.decode(tokens[:50]))


def _steps(ranks: list[BatchStream], n: int) -> list[list[int]]:
    """n steps of every dp rank's stream; each step's union of the ranks' indices, sorted."""
    return [sorted(i for s in ranks for i in s.next_indices().tolist()) for _ in range(n)]


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4), (4, 1)])
def test_a_stream_resumed_with_another_dp_degree_repeats_and_skips_nothing(before, after):
    """Steps of a `before`-way stream (44 windows, batch 8: 5 steps an epoch, 4 windows dropped),
    its state saved after 7 steps (in epoch 1), resumed `after`-way: the union of each step's
    batches is the uninterrupted 1-rank stream's batch, through plait.data's sampler."""
    data = TokenWindows(torch.arange(44 * 8 + 1), seq_len=8, split="train", val_fraction=0)
    n, batch = len(data), 8
    one = BatchStream(data, global_batch=batch, dp_rank=0, dp_size=1, seed=3)
    want = [sorted(one.next_indices().tolist()) for _ in range(12)]
    ranks = [BatchStream(data, global_batch=batch, dp_rank=r, dp_size=before, seed=3) for r in range(before)]
    got = _steps(ranks, 7)
    state = ranks[0].state_dict()
    assert all(r.state_dict() == state for r in ranks)  # global, the same on every rank
    assert state["epoch"] == 1 and state["consumed"] == 16
    resumed = [BatchStream(data, global_batch=batch, dp_rank=r, dp_size=after, seed=3) for r in range(after)]
    for r in resumed:
        r.load_state_dict(state)
    got += _steps(resumed, 5)
    assert got == want
    per_epoch = n // batch  # steps per epoch; the remainder is dropped
    assert all(len(set(s)) == batch for s in got)
    first_epoch = [i for s in got[:per_epoch] for i in s]
    assert len(first_epoch) == len(set(first_epoch))  # no sample twice within an epoch
