"""Text for language modelling: a corpus every machine has, a tokenizer, fixed-length windows.

    corpus files (sorted relative paths: the same order everywhere; walked in that order, so a
    `max_bytes` corpus reads and lists only the files it needs) -> bytes, files joined by
    "\\n\\n" -> tokenizer (byte: token = byte, vocab 256; bpe: the `tokenizers` package, trained
    on this corpus once and cached as JSON) -> tokens (N,) int64 -> TokenWindows: window i is
    tokens[i*seq_len : i*seq_len + seq_len + 1] (inputs window[:-1], targets window[1:]);
    every k-th window (k = round(1 / val_fraction)) is the held-out split, the rest train.

The default corpus is the running interpreter's standard library sources
(`sysconfig.get_paths()["stdlib"]`, site-packages excluded): real text that is on every
machine with Python, offline. Everything here is deterministic: same files, same tokens,
same windows on every rank and every run, so a data-parallel sampler only has to agree on
indices.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

SEPARATOR = b"\n\n"
PRUNED = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | Path | None = None, *, glob: str = "**/*.py") -> list[Path]:
    """The corpus's files in a fixed order: a single file, or `glob` under a folder (default:
    the standard library, without site-packages), sorted by relative path."""
    files = list(iter_corpus_files(root, glob=glob))
    if not files:
        raise ValueError(f"no files matching {glob!r} under {str(root or stdlib_dir())!r}")
    return files


def iter_corpus_files(root: str | Path | None = None, *, glob: str = "**/*.py") -> Iterator[Path]:
    """`corpus_files` one file at a time, in the same order: a reader that stops at `max_bytes`
    (the trainer's 300 kB of a 30 MB standard library) lists a few folders, not all 175 (every
    rank listed and sorted the whole tree per run: 0.18 s of CPU, most of a 1-rank tiny run)."""
    root = stdlib_dir() if root is None or root == "" else Path(root)
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        raise ValueError(f"data path {str(root)!r} is neither a file nor a folder")
    recursive, pattern = glob.startswith("**/"), glob.removeprefix("**/")
    if "/" in pattern:
        raise ValueError(f"data.glob {glob!r}: give a file-name pattern, optionally after '**/'")
    yield from _walk(root, pattern, recursive)


def _walk(folder: Path, pattern: str, recursive: bool) -> Iterator[Path]:
    """Files under `folder` matching `pattern`, in the order of their relative paths as strings,
    skipping site-packages and __pycache__. Depth-first with each folder's entries sorted by
    name, a sub-folder's name taken with its "/": then "a-b.py" < "a/x.py" < "a0.py", as the
    full paths compare, so no listing of the whole tree is needed to know the first file."""
    entries = []
    with os.scandir(folder) as it:
        for entry in it:
            if entry.is_dir():  # a link to a folder is not followed, as os.walk does not
                if recursive and entry.name not in PRUNED and not entry.is_symlink():
                    entries.append((entry.name + "/", entry))
            elif fnmatch.fnmatchcase(entry.name, pattern):
                entries.append((entry.name, entry))
    for key, entry in sorted(entries, key=lambda e: e[0]):
        if key.endswith("/"):
            yield from _walk(Path(entry.path), pattern, recursive)
        else:
            yield Path(entry.path)


def read_corpus(files: Iterable[Path], *, max_bytes: int = 0) -> bytes:
    """The files' bytes joined by a blank line, cut at `max_bytes` (0: everything)."""
    parts, total = [], 0
    for path in files:
        data = path.read_bytes()
        parts.append(data)
        total += len(data) + len(SEPARATOR)
        if max_bytes and total >= max_bytes:
            break
    text = SEPARATOR.join(parts)
    return text[:max_bytes] if max_bytes else text


class ByteTokenizer:
    """Token = byte (0..255); decoding replaces invalid UTF-8."""

    vocab_size = 256
    name = "byte"

    def encode(self, data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)

    def decode(self, tokens: list[int] | torch.Tensor) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` package, trained on the corpus, cached as JSON.

    The cache file is named after a hash of the corpus and the vocabulary size, so a changed
    corpus trains a new one; several ranks reaching an absent cache at once each train the
    same tokenizer (deterministic) and replace the file atomically."""

    name = "bpe"

    def __init__(self, tokenizer: object) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train_or_load(cls, text: bytes, *, vocab_size: int, cache_dir: str | Path) -> BPETokenizer:
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ModuleNotFoundError:
            raise ModuleNotFoundError("--data.tokenizer bpe needs the `tokenizers` package: "
                                      "pip install 'plait[bpe]'") from None
        digest = hashlib.sha256(text).hexdigest()[:16]
        path = Path(cache_dir) / f"bpe-{vocab_size}-{digest}.json"
        if path.exists():
            return cls(Tokenizer.from_file(str(path)))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_lines(text), trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
        return cls(tok)

    def encode(self, data: bytes) -> torch.Tensor:
        ids: list[int] = []
        for enc in self._tok.encode_batch([c.decode("utf-8", errors="replace") for c in _chunks(data)]):
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, tokens: list[int] | torch.Tensor) -> str:
        return self._tok.decode([int(t) for t in tokens])


def _lines(text: bytes, size: int = 1 << 16) -> Iterator[str]:
    for chunk in _chunks(text, size):
        yield chunk.decode("utf-8", errors="replace")


def _chunks(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    """Pieces of about `size` bytes cut after a newline, so no UTF-8 character is split."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start + size)
        end = len(data) if end < 0 else end + 1
        yield data[start:end]
        start = end


class TokenWindows(Dataset):
    """Fixed-length windows of a token stream, split train / held-out (see the module note).

    Item i of a split: a (seq_len + 1,) int64 tensor; inputs item[:-1], targets item[1:]."""

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, split: str = "train",
                 val_fraction: float = 0.02) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        total = (tokens.numel() - 1) // seq_len
        every = max(2, round(1 / val_fraction)) if val_fraction > 0 else 0
        windows = torch.arange(total)
        held = (windows % every == every - 1) if every else torch.zeros(total, dtype=torch.bool)
        self.index = windows[held] if split == "val" else windows[~held]
        if len(self.index) == 0:
            raise ValueError(f"the corpus gives {total} windows of seq_len {seq_len} ({tokens.numel()} tokens): "
                             f"none for the {split} split; use more data or a shorter seq_len")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.index[i]) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


def build_corpus(*, path: str = "", glob: str = "**/*.py", max_bytes: int = 0, tokenizer: str = "byte",
                 vocab_size: int = 1024, cache_dir: str | Path = ".") -> tuple[torch.Tensor, object]:
    """(tokens (N,) int64, tokenizer) for the corpus at `path` (default: the standard library)."""
    text = read_corpus(iter_corpus_files(path or None, glob=glob), max_bytes=max_bytes)
    if not text:
        corpus_files(path or None, glob=glob)  # no file matched: its error names the glob
    if tokenizer == "byte":
        tok: object = ByteTokenizer()
    elif tokenizer == "bpe":
        tok = BPETokenizer.train_or_load(text, vocab_size=vocab_size, cache_dir=cache_dir)
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r}: byte or bpe")
    return tok.encode(text), tok
