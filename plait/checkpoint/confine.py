"""The files a checkpoint names stay inside its folder: plain names, regular files, no links.

    a name from metadata.json (a chunk's file, `files`, `file_meta`) or from a torch DCP
    .metadata (a storage entry's relative_path)
      -> check_name: one path component: not "", "." or "..", no "/", "\\" or NUL
      -> open_regular(folder/name): O_NOFOLLOW | O_NONBLOCK, then fstat: a regular file, or
         CorruptCheckpointError naming the entry

Why: metadata's crc32 is a checksum, not a signature; whoever can write the folder can write a
metadata.json that names /etc/passwd, ../../secret or a FIFO, and recompute the checksum.
Read, such a name would copy an outside file into a converted checkpoint, print its size (or,
through a 1-byte chunk, the crc32 of any byte of it) in `verify`, or hang every reader on the
FIFO. A name of one component cannot leave the folder but through a link, and O_NOFOLLOW
refuses a link there; O_NONBLOCK makes opening a FIFO return at once, and fstat then refuses
it. metadata.json itself is opened the same way.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from plait.checkpoint.metadata import CorruptCheckpointError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; elsewhere the lstat check below stands in
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def check_name(name: object, *, what: str) -> str:
    """`name` if it is a plain file name inside a checkpoint folder; `what` names the entry
    ("metadata.json's chunk 0 of tensor 'w'") in the error."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise CorruptCheckpointError(f"{what} names the file {name!r}: a checkpoint's files are plain names "
                                     "inside its folder (no path, no '..'); refusing to read it")
    return name


def _link(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{what} ({path}) is a symbolic link; a checkpoint's files are regular files "
                                  "inside its folder, and plait does not follow links out of it")


def open_regular(path: str, *, what: str) -> BinaryIO:
    """`path` opened for reading if it is a regular file and not a link; FileNotFoundError as
    open() raises it (callers name the missing file their way)."""
    if not _NOFOLLOW and os.path.islink(path):
        raise _link(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:
        if os.path.islink(path):  # ELOOP (Linux), EMLINK (FreeBSD): O_NOFOLLOW met a link
            raise _link(path, what) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket",
                stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(mode), "not a file")
        raise CorruptCheckpointError(f"{what} ({path}) is {kind}, not a regular file; refusing to read it")
    return os.fdopen(fd, "rb")
