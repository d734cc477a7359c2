"""What must agree across the ranks of a group for an op to be correct, and how a
disagreement is classified and blamed. Shared by the live check (DETAIL), the desync
report and the analyzer, so all three name a problem the same way.

    op record (event or dump entry) -> fingerprint {op, reduce_op, root, shapes, dtypes}
    {rank: fingerprint} -> classify -> Disagreement(kind, sides, culprits) | None

Per op, the shapes that must match are the ones every rank has the same: the input of an
all-reduce or broadcast, the output of an all-gather (inputs may be uneven), the input of
a reduce-scatter (outputs may be uneven); all-to-all may be uneven both ways, so only its
dtypes must match. Kinds are torch's analyzer's categories.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

MISSING_RANK = "missing rank"
OP_TYPE = "op type mismatch"
SIZE = "size mismatch"
DTYPE = "dtype mismatch"
STATE = "state mismatch"
NOT_COMPLETED = "entered by all, completed by none"

_SHAPES_FROM = {
    "all_reduce": "input", "broadcast": "input", "reduce": "input", "gather": "input",
    "reduce_scatter": "input", "all_gather": "output", "scatter": "output",
    "all_to_all": None, "barrier": None, "send": "input", "recv": "output",
}
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})
_REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})
# the fields in the order a difference in them is reported: the first one that differs names the kind
_FIELDS = (("op", OP_TYPE), ("reduce_op", OP_TYPE), ("root", OP_TYPE), ("shapes", SIZE), ("dtypes", DTYPE))


def _dtype(d: object) -> str:
    return str(d).removeprefix("torch.")


def fingerprint(record: Mapping | object) -> dict:
    """The fields of an op that must agree across ranks. `record` is a dump entry (dict)
    or anything with CommEvent's attributes."""
    get = record.get if isinstance(record, Mapping) else (lambda k, _r=record: getattr(_r, k))
    op = get("op")
    side = _SHAPES_FROM.get(op, "input")
    if side is None:
        shapes = None
        dtypes = [_dtype(d) for d in get("input_dtypes") or get("output_dtypes")]
    else:
        shapes = [list(s) for s in get(f"{side}_shapes")]
        dtypes = [_dtype(d) for d in get(f"{side}_dtypes")]
    if op == "barrier":
        dtypes = []
    return {
        "op": "send/recv" if op in ("send", "recv") else op,
        "reduce_op": get("reduce_op") if op in _REDUCING else None,
        "root": get("peer") if op in _ROOTED else None,
        "shapes": shapes,
        "dtypes": dtypes,
    }


def describe(record: Mapping) -> str:
    """One op in a few words: 'all_reduce(sum) (4, 8) float32', 'send to 1 (4,) float32'."""
    op = record["op"]
    if op in ("send", "recv"):
        fp = {"shapes": record.get("input_shapes") or record.get("output_shapes"),
              "dtypes": record.get("input_dtypes") or record.get("output_dtypes")}
        head = f"{op} {'to' if op == 'send' else 'from'} {record.get('peer')}"
    else:
        fp = record if "shapes" in record and "input_shapes" not in record else fingerprint(record)
        head = op + (f"({fp['reduce_op']})" if fp.get("reduce_op") else "")
        if fp.get("root") is not None:
            head += f" root {fp['root']}"
    shapes = ", ".join(str(tuple(s)) for s in fp.get("shapes") or [])
    dtypes = ", ".join(fp.get("dtypes") or [])
    return " ".join(x for x in (head, shapes, dtypes) if x)


@dataclass
class Disagreement:
    kind: str
    sides: list[tuple[dict, list[int]]]  # (fingerprint, ranks holding it), largest side first
    culprits: list[int] = field(default_factory=list)  # empty: the evidence does not say


def classify(fingerprints: Mapping[int, dict]) -> Disagreement | None:
    """Compare the fingerprints of one op across ranks; None when they all agree."""
    by_key: dict[str, tuple[dict, list[int]]] = {}
    for rank in sorted(fingerprints):
        fp = fingerprints[rank]
        key = json.dumps([fp.get(name) for name, _ in _FIELDS])
        by_key.setdefault(key, (fp, []))[1].append(rank)
    if len(by_key) <= 1:
        return None
    sides = sorted(by_key.values(), key=lambda s: (-len(s[1]), s[1]))
    kind = next(kind for name, kind in _FIELDS
                if len({json.dumps(fp.get(name)) for fp in fingerprints.values()}) > 1)
    return Disagreement(kind, sides, minority(sides))


def minority(sides: list[tuple[object, list[int]]]) -> list[int]:
    """The ranks outside the one largest side; empty on a tie (1:1 cannot be judged)."""
    sizes = sorted((len(ranks) for _, ranks in sides), reverse=True)
    if len(sizes) < 2 or sizes[0] == sizes[1]:
        return []
    biggest = max(sides, key=lambda s: len(s[1]))
    return sorted(r for fp, ranks in sides if fp is not biggest[0] for r in ranks)


def missing_culprits(entered: list[int], missing: list[int], status: Mapping[int, str]) -> list[int]:
    """Who is to blame when `entered` ranks wait in an op that `missing` ranks never issued.

    The smaller side took a different path. On a tie the ranks' own states decide: if every
    missing rank finished its program, the entered ones issued an op too many; if a missing
    rank is alive outside any op (computing, sleeping), it is the one that is late.
    """
    if len(missing) != len(entered):
        return sorted(missing) if len(missing) < len(entered) else sorted(entered)
    if missing and all(status.get(r) == "exited" for r in missing):
        return sorted(entered)
    if any(status.get(r) == "running" for r in missing):
        return sorted(missing)
    return []
