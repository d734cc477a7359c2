"""Drive any SavePlanner/StorageWriter (LoadPlanner/StorageReader) in torch's DCP call order.

    save: every rank: storage_meta -> planner.set_up_planner -> writer.set_up_storage_writer
            -> planner.create_local_plan -> writer.prepare_local_plan
          exchange plans -> coordinator (rank 0): planner.create_global_plan ->
            writer.prepare_global_plan -> each rank gets its plan
          every rank: planner.finish_plan -> writer.write_data(plan, planner).wait()
          exchange WriteResults -> coordinator: writer.finish(metadata, results) -> Metadata
    load: every rank: reader.read_metadata -> planner.set_up_planner -> reader.set_up_storage_reader
            -> planner.create_local_plan -> reader.prepare_local_plan
          exchange -> coordinator: planner.create_global_plan -> reader.prepare_global_plan
          every rank: planner.finish_plan -> reader.read_data(plan, planner).wait()

As torch's state_dict_saver / state_dict_loader do, with two differences: plans travel as
JSON (plan_codec) through plait.comm, not pickle; and each exchange also carries every
rank's failure, so a failure anywhere raises CheckpointException on every rank at the next
exchange (torch's semantics) and no rank waits for one that has already failed.
TODO(size): each exchange is an all_gather (group.py), so every rank receives the whole
global plan, not only its own as torch's scatter gives; it is JSON of the chunk list,
the size of metadata.json.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from plait.checkpoint.group import Group
from plait.checkpoint.plan_codec import from_wire, to_wire
from plait.checkpoint.planner_api import LoadPlanner, Metadata, SavePlanner
from plait.checkpoint.stateful import Stateful, expand
from plait.checkpoint.storage_api import CheckpointException, StorageReader, StorageWriter, wait


def _exchange(group: Group, what: str, error: BaseException | None, payload: Any = None) -> list[Any]:
    """Collective: every rank's payload, or CheckpointException on every rank if any failed."""
    wire = None
    if error is None:
        try:
            wire = to_wire(payload)
        except TypeError as e:
            error = e
    msg = None if error is None else f"{type(error).__name__}: {error}"
    got = group.gather_json([msg, wire])
    failures: dict[int, BaseException | str] = {r: m for r, (m, _) in enumerate(got) if m is not None}
    if failures:
        if error is not None:
            failures[group.rank] = error
        raise CheckpointException(f"checkpoint {what} failed on rank(s) {sorted(failures)}", failures) from error
    return [from_wire(p) for _, p in got]


def _call_with_rank(method, first: tuple, group: Group) -> None:
    """torch passes rank= and use_collectives= only to a method that takes **kwargs."""
    params = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        method(*first, rank=group.rank, use_collectives=True)
    else:
        method(*first)


def save_with(state_dict: dict[str, Any], writer: StorageWriter, planner: SavePlanner, group: Group) -> Metadata:
    coordinator = group.rank == 0
    error, plan = None, None
    try:
        expanded, _ = expand(state_dict)
        storage_meta = writer.storage_meta()
        if "storage_meta" in inspect.signature(planner.set_up_planner).parameters:
            planner.set_up_planner(state_dict=expanded, storage_meta=storage_meta, is_coordinator=coordinator)
        else:  # the older signature torch still accepts (with a warning)
            planner.set_up_planner(expanded, coordinator)
        _call_with_rank(writer.set_up_storage_writer, (coordinator,), group)
        plan = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        error = e
    all_plans = _exchange(group, "planning", error, plan)
    global_plans, metadata = None, None
    if coordinator:
        try:
            global_plans, metadata = planner.create_global_plan(all_plans)
            global_plans = writer.prepare_global_plan(global_plans)
            if len(global_plans) != group.size:
                raise ValueError(f"create_global_plan/prepare_global_plan returned {len(global_plans)} plans "
                                 f"for {group.size} ranks: one plan per rank, in rank order")
        except Exception as e:  # noqa: BLE001
            error = e
    central = _exchange(group, "global planning", error, global_plans)[0][group.rank]
    results = None
    try:
        final = planner.finish_plan(central)
        results = wait(writer.write_data(final, planner))
    except Exception as e:  # noqa: BLE001
        error = e
    all_results = _exchange(group, "write", error, results)
    if coordinator:
        try:
            writer.finish(metadata=metadata, results=all_results)
        except Exception as e:  # noqa: BLE001
            error = e
    return _exchange(group, "commit", error, metadata if coordinator else None)[0]


def load_with(state_dict: dict[str, Any], reader: StorageReader, planner: LoadPlanner, group: Group) -> None:
    coordinator = group.rank == 0
    error, plan = None, None
    expanded, members = expand(state_dict)
    try:
        metadata = reader.read_metadata()
        planner.set_up_planner(expanded, metadata, coordinator)
        _call_with_rank(reader.set_up_storage_reader, (metadata, coordinator), group)
        plan = reader.prepare_local_plan(planner.create_local_plan())
    except Exception as e:  # noqa: BLE001
        error = e
    all_plans = _exchange(group, "load planning", error, plan)
    global_plans = None
    if coordinator:
        try:
            global_plans = reader.prepare_global_plan(planner.create_global_plan(all_plans))
        except Exception as e:  # noqa: BLE001
            error = e
    central = _exchange(group, "load global planning", error, global_plans)[0][group.rank]
    try:
        with torch.no_grad():
            wait(reader.read_data(planner.finish_plan(central), planner))
    except Exception as e:  # noqa: BLE001
        error = e
    _exchange(group, "read", error)
    # tensors were filled in place and values assigned into `expanded` (load_bytes), as torch's
    for k, member in members.items():
        member.load_state_dict(expanded[k])
    for k, v in expanded.items():
        if k not in members and not isinstance(v, Stateful):
            state_dict[k] = v
