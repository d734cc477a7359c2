"""visualize_sharding: print which rank holds which index ranges of a 1-D or 2-D DTensor.

    visualize_sharding(x)        # Shard(0) of an 8 x 4 tensor on a mesh of 2, printed once:
                  Col 0-3
        -------  ---------
        Row 0-3  cpu:0
        Row 4-7  cpu:1

Data flow: every rank of the mesh -> its coordinate -> the local shape and global offset
its piece has (placement.local_shape_and_offset, pure) -> (row range, col range, rank) ->
one table, rows and columns sorted by range, ranks sharing a piece listed together.

torch's output, without its dependencies: torch prints with `tabulate` (its "simple"
format, reproduced here in plain text), or with `rich` and `matplotlib` when
use_rich=True; plait always prints the plain table (use_rich is accepted for torch's
signature). As torch's, it prints on the mesh's coordinate-(0, ..., 0) rank only, and
nothing for an empty tensor or on a rank outside the mesh; `header` is accepted and, as
in torch, not printed.
"""

from __future__ import annotations

import itertools

from plait.tensor.dtensor import DTensor
from plait.tensor.placement import local_shape_and_offset

Shard2D = tuple[tuple[int, int], tuple[int, int], int]  # (row range, col range, rank)


def visualize_sharding(dtensor: DTensor, header: str = "", use_rich: bool = False) -> None:  # noqa: ARG001
    """Print the layout of a 1-D or 2-D DTensor (see the module note)."""
    if dtensor.numel() == 0:
        return
    if dtensor.ndim >= 3:
        raise RuntimeError("visualize sharding supports only 1D or 2D DTensor")
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None or any(c != 0 for c in coordinate):
        return  # printed once per DTensor, by the rank at coordinate 0 on every axis
    print(sharding_table(shards(dtensor), device_kind=mesh.device_type))


def shards(dtensor: DTensor) -> list[Shard2D]:
    """Every mesh rank's piece as inclusive (row range, col range), a 1-D tensor as one column."""
    mesh = dtensor.device_mesh
    ranks = mesh.mesh.tolist()
    out = []
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        rank = ranks
        for c in coord:
            rank = rank[c]
        shape, offset = local_shape_and_offset(dtensor.shape, dtensor.placements, mesh.shape, coord)
        if len(shape) == 1:
            shape, offset = (shape[0], 1), (offset[0], 0)
        out.append(((offset[0], offset[0] + shape[0] - 1), (offset[1], offset[1] + shape[1] - 1), int(rank)))
    return out


def sharding_table(pieces: list[Shard2D], *, device_kind: str = "") -> str:
    """The table torch prints: one row per row range, one column per column range, each cell
    `device_kind:rank[,rank...]` -- tabulate's "simple" format (cells left-aligned, a column
    as wide as its widest cell and at least its header + 2, columns two spaces apart)."""
    rows = sorted({p[0] for p in pieces})
    cols = sorted({p[1] for p in pieces})
    cells = [["" for _ in cols] for _ in rows]
    for row, col, rank in pieces:
        cell = cells[rows.index(row)]
        j = cols.index(col)
        cell[j] = f"{device_kind}:{rank}" if cell[j] == "" else f"{cell[j]},{rank}"
    headers = [""] + [f"Col {a}-{b}" for a, b in cols]
    body = [[f"Row {a}-{b}", *cell] for (a, b), cell in zip(rows, cells)]
    widths = [max(len(h) + 2, *(len(r[k]) for r in body)) for k, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in body)])


__all__ = ["sharding_table", "shards", "visualize_sharding"]
