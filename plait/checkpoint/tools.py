"""`plait checkpoint inspect | verify | consolidate | import-torch-dcp`.

    inspect PATH                  tensors (shape, dtype, saved layout, chunks), values, size
    verify PATH                   every byte: metadata.json's crc32, each file's size and header
                                  crc32, every chunk's crc32, the tiling; exit 1 naming each
                                  problem, then "checkpoint PATH is corrupt" and the previous one
    consolidate PATH OUT.safetensors   one full-tensor file any safetensors reader opens
                                  (non-tensor values in its __metadata__["plait.values"], JSON)
    import-torch-dcp DIR OUT      a torch.distributed.checkpoint directory -> plait checkpoint

Each reads through the same checked path as load (validate.read: metadata.json's fields, names
and tiling, before any tensor file is opened; then each file and chunk), one process.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys

import torch

from plait.checkpoint import commit, integrity, validate
from plait.checkpoint.metadata import CorruptCheckpointError, Metadata, dtype_from_name
from plait.checkpoint.safetensors_io import check_file, read_chunk
from plait.checkpoint.storage import FileSystemReader


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def inspect(path: str) -> str:
    md = FileSystemReader(path).read_metadata()
    total = sum(t.nbytes for t in md.tensors.values())
    lines = [f"checkpoint {path}: {len(md.tensors)} tensors, {len(md.values)} values, {_mib(total)}, "
             f"saved by {md.world_size} rank(s) into {len(md.files)} file(s)"]
    for fqn, t in md.tensors.items():
        lay = t.layout
        where = (f"mesh {tuple(lay.get('mesh_shape', ()))} {tuple(lay.get('mesh_dim_names') or ())} "
                 f"[{', '.join(map(str, lay['placements']))}]" if lay.get("placements") else lay.get("from", "plain"))
        lines.append(f"  {fqn:<40} {t.dtype:<9} {str(tuple(t.shape)):<16} {where}, {len(t.chunks)} chunk(s)")
    for fqn, v in md.values.items():
        lines.append(f"  {fqn:<40} value {json.dumps(v)[:60]}")
    return "\n".join(lines)


def full_tensor(reader: FileSystemReader, md: Metadata, fqn: str) -> torch.Tensor:
    """The whole tensor from its chunks. They tile it exactly (validate.py), so every element of
    `out` is written; it is allocated once every chunk has been read (and so found in its file)."""
    t = md.tensors[fqn]
    dtype = dtype_from_name(t.dtype)
    chunks = [(c, read_chunk(os.path.join(reader.path, c.file), c, fqn=fqn).view(dtype).view(c.sizes))
              for c in t.chunks]
    if len(chunks) == 1 and list(chunks[0][0].sizes) == list(t.shape):
        return chunks[0][1]
    out = torch.empty(t.shape, dtype=dtype)
    for c, src in chunks:
        dst = out
        for d, (o, n) in enumerate(zip(c.offsets, c.sizes)):
            dst = dst.narrow(d, o, n)
        dst.copy_(src)
    return out


def _file_problems(path: str, md: Metadata) -> tuple[list[str], set[str]]:
    """Each file's size and header crc32, and that its header and chunks tile it (no byte
    outside a checksum); the problems and the files that are missing."""
    problems, missing = [], set()
    chunks: dict[str, list[tuple[int, int, str]]] = {f: [] for f in md.files}
    for fqn, t in md.tensors.items():
        for c in t.chunks:
            chunks.setdefault(c.file, []).append((c.begin, c.nbytes, fqn))
    for file, spans in chunks.items():
        meta = md.file_meta.get(file)
        if meta is None:
            if md.file_meta:  # version 1 records none; a version-2 file without one is unchecked bytes
                problems.append(f"file {file!r} has no recorded size and header checksum")
            continue
        try:
            check_file(os.path.join(path, file), meta, file=file, fqns=[f for _, _, f in spans])
        except CorruptCheckpointError as e:  # missing, truncated, damaged; a link or a FIFO
            problems.append(str(e))
            missing |= {file} if not os.path.isfile(os.path.join(path, file)) or os.path.islink(
                os.path.join(path, file)) else set()
        at = meta.header_nbytes
        for begin, nbytes, fqn in sorted(spans):
            if begin != at:
                problems.append(f"file {file!r}: bytes [{at}, {begin}) before tensor {fqn!r} are under no checksum")
            at = max(at, begin + nbytes)
        if at != meta.size:
            problems.append(f"file {file!r}: its chunks end at byte {at}, the file has {meta.size}")
    return problems, missing


def verify(path: str) -> list[str]:
    """Every problem found (empty: the checkpoint is complete and intact)."""
    problem = commit.status(path)
    if problem is not None:
        return [problem]
    try:
        md = validate.read(path)  # names, byte ranges, the tiling: checked before any file is opened
    except (ValueError, OSError) as e:
        return [str(e)]
    problems, missing = _file_problems(path, md)
    for fqn, t in md.tensors.items():
        for c in t.chunks:
            if c.file in missing:  # said once, by _file_problems
                continue
            try:
                read_chunk(os.path.join(path, c.file), c, fqn=fqn)
            except CorruptCheckpointError as e:
                problems.append(str(e))
    return problems


def _verify_main(path: str) -> int:
    problems = verify(path)
    if problems and commit.status(path) is not None:  # not committed (incomplete, missing): not corrupt
        print(f"FAIL {problems[0]}{integrity.fallback(path)}", file=sys.stderr)
        return 1
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if not problems:
        md = FileSystemReader(path).read_metadata()
        unsummed = " (format version 1: its headers and metadata.json carry no checksum)" if (
            md.files and not md.file_meta) else ""
        print(f"OK {path}: every checksum matches{unsummed}")
        return 0
    print(f"FAIL {integrity.describe(path, f'{len(problems)} problem(s) above')}", file=sys.stderr)
    return 1


def consolidate(path: str, out: str) -> None:
    from safetensors.torch import save_file

    reader = FileSystemReader(path)
    md = reader.read_metadata()
    tensors = {fqn: full_tensor(reader, md, fqn) for fqn in md.tensors}
    save_file(tensors, out, metadata={"format": "pt", "plait.values": json.dumps(md.values)})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plait checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="tensors, shapes, dtypes, saved layout, size").add_argument("path")
    sub.add_parser("verify", help="check every checksum; non-zero exit on a problem").add_argument("path")
    c = sub.add_parser("consolidate", help="write one full-state safetensors file")
    c.add_argument("path")
    c.add_argument("out")
    i = sub.add_parser("import-torch-dcp", help="convert a torch.distributed.checkpoint directory")
    i.add_argument("dir")
    i.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "inspect":
            print(inspect(args.path))
        elif args.cmd == "verify":
            return _verify_main(args.path)
        elif args.cmd == "consolidate":
            consolidate(args.path, args.out)
            print(f"wrote {args.out}")
        else:
            from plait.checkpoint.dcp_import import import_torch_dcp

            n = import_torch_dcp(args.dir, args.out)
            print(f"converted {args.dir} -> {args.out}: {n['tensors']} tensors, {n['values']} values")
    except (ValueError, OSError, pickle.UnpicklingError) as e:
        print(f"plait checkpoint {args.cmd}: {e}", file=sys.stderr)
        return 1
    return 0
