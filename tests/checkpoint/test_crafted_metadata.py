"""metadata.json is checked once, when read, and load, verify, consolidate and inspect share the
check: a chunk listed twice, missing, outside its tensor or its file, a byte count that is not
dtype x numel, a dtype safetensors cannot hold are errors naming the tensor and the chunk (they
loaded uninitialised memory, or passed verify). Then a seeded fuzz: random edits of a valid
metadata.json, its checksum recomputed, never hang, never raise but the clear error, never open
a file outside the folder and never hand out an element no chunk wrote.
"""

from __future__ import annotations

import builtins
import copy
import os
import random

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint import tools
from tests.checkpoint._crafted import empty, read_body, save, write_body
from tests.checkpoint.test_confined import no_hang  # noqa: F401 - a FIFO read fails the test, not hangs it


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base") / "ckpt")
    save(path)
    return path, read_body(path)


def _chunks(body):
    return body["tensors"]["w"]["chunks"]


def _dup(b):
    _chunks(b).append(copy.deepcopy(_chunks(b)[0]))


def _drop(b):
    _chunks(b).pop()


def _negative(b):
    _chunks(b)[1]["offsets"] = [-32, 0]


def _begin(b):
    _chunks(b)[0]["begin"] = -8


def _huge(b):
    _chunks(b)[0]["nbytes"] = 10**15


def _shape(b):
    b["tensors"]["w"]["shape"] = [2**40, 64]


def _dtype(b):
    b["tensors"]["s"]["dtype"] = "complex32"


def _past_file(b):
    c = _chunks(b)[1]
    c["begin"] = next(iter(b["file_meta"].values()))["size"] - 8


def _overlap(b):
    _chunks(b)[1]["offsets"] = [2, 0]
    _chunks(b)[1]["sizes"] = [4, 4]


CASES = {  # edit -> what the error says
    "chunk listed twice": (_dup, "tensor 'w' chunk 2 (offsets [0, 0], sizes [4, 4]) is at the offsets of chunk 0"),
    "chunk missing": (_drop, "tensor 'w' of shape [8, 4]: element [4, 0] is in no chunk"),
    "offsets [-32, 0]": (_negative, "tensor 'w' chunk 1: offsets is [-32, 0]: -32 is not an integer in [0, 2**63)"),
    "negative begin": (_begin, "tensor 'w' chunk 0 (offsets [0, 0], sizes [4, 4]): begin is -8"),
    "nbytes 10**15": (_huge, "tensor 'w' chunk 0 (offsets [0, 0], sizes [4, 4]): nbytes 1000000000000000, but 16 "
                             "elements of float32 are 64 bytes"),
    "unsupported dtype": (_dtype, "tensor 's': dtype 'complex32' in checkpoint metadata is not one safetensors stores"),
    "past the file": (_past_file, "tensor 'w' chunk 1 (offsets [4, 0], sizes [4, 4]): bytes ["),
    "overlapping": (_overlap, "tensor 'w' chunk 1 (offsets [2, 0], sizes [4, 4]) overlaps chunk 0"),
}
CASES["shape [2**40, 64]"] = (_shape, "tensor 'w' of shape [1099511627776, 64]: element [0, 4] is in no chunk")


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_chunks_are_refused_by_every_reader(base, tmp_path, capsys, case):
    edit, said = CASES[case]
    path = str(tmp_path / "ckpt")
    _copy(base[0], path)
    body = copy.deepcopy(base[1])
    edit(body)
    write_body(path, body)
    with pytest.raises(dcp.CorruptCheckpointError) as e:
        dcp.load(empty(), checkpoint_id=path)
    assert said in str(e.value) and f"checkpoint {path} is corrupt" in str(e.value), str(e.value)
    assert len(tools.verify(path)) == 1 and said in tools.verify(path)[0]
    capsys.readouterr()
    out = str(tmp_path / "out.safetensors")
    assert [tools.main(["verify", path]), tools.main(["consolidate", path, out]), tools.main(["inspect", path])] == [1] * 3
    err = capsys.readouterr().err
    assert err.count(said) == 3 and "Traceback" not in err and not os.path.exists(out), err


def _copy(src: str, dst: str) -> None:
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())


# --- the fuzz -----------------------------------------------------------------------------

SENTINEL = 171  # what torch.empty holds here: an element no chunk wrote still reads 171
VALUES = [-1, 0, 1, 2, 3, 4, 7, 8, 16, 32, -32, 2**31, 2**40, 2**63, 10**15, None, True, 1.5, "", "x", [], {},
          [0], [0, 0], [4, 0], [-32, 0], [2**40, 64], [1, 4], "float32", "bfloat16", "int8", "complex32",
          "../secret.txt", "SECRET_ABS", "link", "fifo", "sub", ".", "..", "metadata.json", "__0_0.safetensors",
          {"$raw": "%%"}, {"$tuple": 3}, {"$dict": [[1]]}, {"$device": "nowhere"}, {"$float": "x"}]


def _nodes(obj, path=()):
    """Every (container path, key) in the body: what an edit can change."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield path, k
        yield from _nodes(v, (*path, k))


def _edit(body: dict, rng: random.Random, secret: str) -> None:
    path, key = rng.choice(list(_nodes(body)))
    parent = body
    for k in path:
        parent = parent[k]
    op = rng.random()
    if op < 0.25:  # one field of two chunks swapped: often still sound (offsets: the halves trade places)
        w = body["tensors"].get("w") if isinstance(body.get("tensors"), dict) else None
        chunks = w.get("chunks") if isinstance(w, dict) else None
        if isinstance(chunks, list) and len(chunks) == 2 and all(isinstance(c, dict) for c in chunks):
            k = rng.choice(["offsets", "offsets", "name", "begin", "crc32", "sizes", "file"])
            if k in chunks[0] and k in chunks[1]:
                chunks[0][k], chunks[1][k] = chunks[1][k], chunks[0][k]
    elif op < 0.35:  # remove it
        del parent[key]
    elif op < 0.45 and isinstance(parent, list):  # list it twice
        parent.append(copy.deepcopy(parent[key]))
    elif op < 0.55 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice([-1, 1, -4, 4, 16])
    else:
        v = copy.deepcopy(rng.choice(VALUES))
        parent[key] = secret if v == "SECRET_ABS" else v


def _outside_opens(root: str, monkeypatch) -> list[str]:
    """Files opened (successfully) outside `root`, seen through /proc/self/fd (what was opened,
    not the name asked for)."""
    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def check(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not target.startswith(root + os.sep):
            seen.append(target)

    def os_open(path, flags, *args, **kwargs):
        fd = real_os_open(path, flags, *args, **kwargs)
        check(fd)
        return fd

    def open_(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if not isinstance(file, int):
            check(f.fileno())
        return f

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(SENTINEL))
    return seen


def _no_sentinel(tensors) -> bool:
    return all(not bool((t.float() == SENTINEL).any()) for t in tensors)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads what was opened from /proc/self/fd")
def test_fuzzed_metadata_never_hangs_leaks_or_loads_garbage(base, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    root = str(tmp_path.resolve())
    secret = str(tmp_path.parent / f"{tmp_path.name}-secret.txt")
    with open(secret, "wb") as f:
        f.write(b"outside")
    path = os.path.join(root, "ckpt")
    _copy(base[0], path)
    os.mkfifo(os.path.join(path, "fifo"))
    os.mkdir(os.path.join(path, "sub"))
    os.symlink(secret, os.path.join(path, "link"))
    outside = _outside_opens(root, monkeypatch)
    outcomes = {"refused": 0, "loaded": 0}
    reasons = []
    for seed in range(150):
        rng = random.Random(seed)
        body = copy.deepcopy(base[1])
        for _ in range(rng.randint(1, 3)):
            _edit(body, rng, secret)
        write_body(path, body)
        state = empty(SENTINEL)
        try:
            dcp.load(state, checkpoint_id=path)
            outcomes["loaded"] += 1
            assert _no_sentinel([state["w"], state["s"]]), (seed, body)
        except ValueError as e:  # CorruptCheckpointError, a key or shape that does not fit
            outcomes["refused"] += 1
            reasons.append(str(e).rsplit(": ", 2)[-2:])
        assert isinstance(tools.verify(path), list)
        out = os.path.join(root, "out.safetensors")
        for argv in (["verify", path], ["inspect", path], ["consolidate", path, out]):
            assert tools.main(argv) in (0, 1), (seed, argv)
        if os.path.exists(out):
            assert _no_sentinel(load_file(out).values()), (seed, body)
            os.remove(out)
        assert not outside, (seed, outside)
    assert "Traceback" not in capsys.readouterr().err
    # the edits reach both paths: refusals (each reason listed if not) and sound edits that load
    assert outcomes["refused"] > 100 and outcomes["loaded"] > 3, (outcomes, "\n".join(map(str, reasons)))
