"""Cut a batch into microbatches and glue the last stage's outputs back, as torch's pipelining does.

    step(x, mask=m) --split_args_kwargs_into_chunks--> [(x_0,), ...], [{mask: m_0}, ...]
    last stage outputs [y_0, y_1, ...] --merge_chunks--> y (concatenated along the batch dim)

Every tensor leaf of the arguments (nested tuples, lists and dicts included) is split along
its chunk dim (the batch dim 0 unless a `TensorChunkSpec` says otherwise) into
`n_microbatches` equal views; anything else is handed to every microbatch as it is. Unlike
torch, which accepts uneven chunks, a size that `n_microbatches` does not divide is an error:
uneven microbatches would weight samples unequally under a mean loss with `scale_grads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


@dataclass(frozen=True)
class TensorChunkSpec:
    """Split (and merge) the tensors of one argument along `split_dim`."""

    split_dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.split_dim, int):
            raise TypeError(f"TensorChunkSpec.split_dim must be an int, got {self.split_dim!r}")

    @staticmethod
    def from_tuple(chunk_dims: tuple[int, ...]) -> tuple[TensorChunkSpec, ...]:
        """One spec per positional argument, from its split dim (torch's helper)."""
        return tuple(TensorChunkSpec(dim) for dim in chunk_dims)

    @staticmethod
    def from_dict(chunk_dims: dict[str, int]) -> dict[str, TensorChunkSpec]:
        """One spec per keyword argument, from its split dim (torch's helper)."""
        return {name: TensorChunkSpec(dim) for name, dim in chunk_dims.items()}


class _Replicate:
    """Give the whole value to every microbatch (torch's `_Replicate`)."""


def _split_value(value: Any, spec: TensorChunkSpec | None, n: int, name: str) -> list[Any]:
    if spec is not None and not isinstance(spec, TensorChunkSpec):
        return [value] * n  # _Replicate, or any non-spec marker
    dim = 0 if spec is None else spec.split_dim
    leaves, tree = tree_flatten(value)
    pieces: list[list[Any]] = []
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            pieces.append([leaf] * n)
            continue
        where = name if len(leaves) == 1 else f"{name} (tensor {k})"
        if not -leaf.dim() <= dim < leaf.dim():
            raise ValueError(
                f"{where}: split dim {dim} does not exist in shape {tuple(leaf.shape)}"
            )
        size = leaf.size(dim)
        if size % n:
            raise ValueError(
                f"{where}: batch size {size} (dim {dim} of shape {tuple(leaf.shape)}) is not "
                f"divisible by n_microbatches {n}"
            )
        pieces.append(list(leaf.split(size // n, dim)))
    return [tree_unflatten([p[i] for p in pieces], tree) for i in range(n)]


def split_args_kwargs_into_chunks(
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    chunks: int,
    args_chunk_spec: Sequence[TensorChunkSpec | None] | None = None,
    kwargs_chunk_spec: dict[str, TensorChunkSpec | None] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Per microbatch, the positional and keyword arguments (torch's function of this name)."""
    if chunks < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {chunks}")
    kwargs = kwargs or {}
    if args_chunk_spec is not None and len(args_chunk_spec) != len(args):
        raise ValueError(
            f"args_chunk_spec has {len(args_chunk_spec)} entries but step() got {len(args)} args"
        )
    arg_pieces = [
        _split_value(
            a, None if args_chunk_spec is None else args_chunk_spec[i], chunks, f"args[{i}]"
        )
        for i, a in enumerate(args)
    ]
    kwarg_pieces = {
        k: _split_value(v, (kwargs_chunk_spec or {}).get(k), chunks, f"kwargs[{k!r}]")
        for k, v in kwargs.items()
    }
    arg_mbs = [tuple(p[i] for p in arg_pieces) for i in range(chunks)]
    kwarg_mbs = [{k: p[i] for k, p in kwarg_pieces.items()} for i in range(chunks)]
    return arg_mbs, kwarg_mbs


def split_tensor(value: Any, chunks: int, name: str = "target") -> list[Any]:
    """Split one value (the loss target) along dim 0 into `chunks` microbatches."""
    return _split_value(value, None, chunks, name)


def merge_chunks(chunks: Sequence[Any], chunk_spec: Any = None) -> Any:
    """Concatenate per-microbatch outputs along their chunk dim (0 unless `chunk_spec` says).

    `chunk_spec` mirrors the output's structure with `TensorChunkSpec`s (or None for dim 0);
    0-dim tensors (a per-microbatch scalar) are stacked; non-tensors come from microbatch 0.
    """
    if not chunks:
        return None
    flat = [tree_flatten(c) for c in chunks]
    leaves0, tree = flat[0]
    if chunk_spec is None:
        specs: list[Any] = [TensorChunkSpec(0)] * len(leaves0)
    else:
        specs, _ = tree_flatten(chunk_spec, is_leaf=lambda s: isinstance(s, TensorChunkSpec))
        if len(specs) != len(leaves0):
            raise ValueError(
                f"output_merge_spec has {len(specs)} leaves but the output has {len(leaves0)}"
            )
    merged = []
    for k, leaf in enumerate(leaves0):
        values = [leaves[k] for leaves, _ in flat]
        spec = specs[k]
        if not isinstance(leaf, torch.Tensor) or not isinstance(spec, TensorChunkSpec):
            merged.append(leaf)
        elif leaf.dim() == 0:
            merged.append(torch.stack(values))
        else:
            merged.append(torch.cat(values, dim=spec.split_dim))
    return tree_unflatten(merged, tree)
