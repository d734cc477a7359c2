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

As torch's state_dict_saver / state_dict_loader do, with torch's three steps: reduce_scatter
(plans gathered to the coordinator, its global plan scattered: rank r receives plan r
only), all_reduce (WriteResults gathered, finish, the Metadata sent back) and all_gather
(load's read errors: one all_reduce of a failure flag, the messages gathered only when a
rank failed, Group.failures). Each step carries every rank's failure, so a failure anywhere raises
CheckpointException on every rank (torch's semantics) and no rank waits for one that has
already failed. Unlike torch, plans travel as JSON (plan_codec) through plait.comm, not pickle.

Shortcuts where a global hook is the built-in one (the class's own function, not overridden
and not patched), each giving the same plans, files and metadata as the full step:
  load, DefaultLoadPlanner.create_global_plan and FileSystemReader.prepare_global_plan (both
      the identity): no plan travels; a rank's central plan is its local plan, and the
      planning step is one all_reduce of a failure flag (load: 5 collectives -> 2)
  save, DefaultSavePlanner.create_global_plan and FileSystemWriter.prepare_global_plan (they
      only drop items): rank r receives the indices of its local items that it writes, not
      its plan (the coordinator still runs both, in torch's order)
  save(..., return_metadata=False) (plain save, whose ranks read the committed record):
      the last step sends only its outcome, one broadcast of a zero length on success
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from plait.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from plait.checkpoint.group import Group
from plait.checkpoint.plan_codec import from_wire, to_wire
from plait.checkpoint.planner_api import LoadPlanner, Metadata, SavePlan, SavePlanner
from plait.checkpoint.stateful import Stateful, expand
from plait.checkpoint.storage import FileSystemReader, FileSystemWriter
from plait.checkpoint.storage_api import CheckpointException, StorageReader, StorageWriter, wait

# the built-in global hooks, as imported (a test that patches one gets the full steps)
_LOAD_IDENTITY = (DefaultLoadPlanner.create_global_plan, FileSystemReader.prepare_global_plan)
_SAVE_FILTER = (DefaultSavePlanner.create_global_plan, FileSystemWriter.prepare_global_plan)


def _hooks_are(planner: Any, storage: Any, builtin: tuple) -> bool:
    return (getattr(type(planner), "create_global_plan", None) is builtin[0]
            and getattr(type(storage), "prepare_global_plan", None) is builtin[1])


def _kept(local: SavePlan, central: SavePlan) -> Any:
    """`central` as the indices of the items of `local` it keeps, where dropping items is all
    it changed (the built-in hooks' plans share the local plan's objects); else itself."""
    if (type(central) is SavePlan and central.storage_data is local.storage_data
            and central.planner_data is local.planner_data and central.usable == local.usable):
        where = {id(it): i for i, it in enumerate(local.items)}
        kept = [where.get(id(it)) for it in central.items]
        if None not in kept:
            return {"kept": kept}
    return central


def _wire(payload: Any, error: BaseException | None) -> tuple[Any, BaseException | None]:
    if error is not None:
        return None, error
    try:
        return to_wire(payload), None
    except TypeError as e:
        return None, e


def _msg(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _raise(what: str, failures: dict[int, BaseException | str], group: Group, error: BaseException | None):
    if error is not None:
        failures[group.rank] = error
    raise CheckpointException(f"checkpoint {what} failed on rank(s) {sorted(failures)}", failures) from error


def _check(group: Group, what: str, error: BaseException | None) -> None:
    """torch's all_gather step of errors: CheckpointException on every rank if any failed."""
    failures: dict[int, BaseException | str] = dict(group.failures(_msg(error)))
    if failures:
        _raise(what, failures, group, error)


def _reduce_scatter(group: Group, what: str, error: BaseException | None, payload: Any,
                    central: Callable[[list[Any]], list[Any] | None], *, outcome_only: bool = False) -> Any:
    """torch's reduce_scatter step: every rank's payload to the coordinator, which runs
    `central` on them (one result per rank) unless a rank failed; rank r gets result r, or
    CheckpointException with every failure. An all_reduce step is one whose results are equal.
    outcome_only: `central` returns None, and only its success or the failures travel back."""
    wire, error = _wire(payload, error)
    got = group.gather_to_coordinator([_msg(error), wire])
    out, failures = None, None
    if group.rank == 0:
        failures = [[r, m] for r, (m, _) in enumerate(got) if m is not None]
        if not failures:
            try:
                results = central([from_wire(p) for _, p in got])
                if not outcome_only:
                    wired: dict[int, list] = {}  # an object sent to many ranks (all_reduce's) is encoded once
                    out = [wired.setdefault(id(x), [None, to_wire(x)]) if id(x) not in wired else wired[id(x)]
                           for x in results]
            except Exception as e:  # noqa: BLE001 - the coordinator's failure must reach every rank
                error, failures = e, [[0, _msg(e)]]
        if failures:
            out = [[failures, None]] * group.size
    if outcome_only:
        failures, value = group.from_coordinator(failures or None), None
    else:
        failures, value = group.scatter_from_coordinator(out)
    if failures:
        _raise(what, {r: m for r, m in failures}, group, error if group.rank in {r for r, _ in failures} else None)
    return from_wire(value)


def _call_with_rank(method, first: tuple, group: Group) -> None:
    """torch passes rank= and use_collectives= only to a method that takes **kwargs."""
    params = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        method(*first, rank=group.rank, use_collectives=True)
    else:
        method(*first)


def save_with(state_dict: dict[str, Any], writer: StorageWriter, planner: SavePlanner, group: Group, *,
              return_metadata: bool = True) -> Metadata | None:
    """return_metadata=False: the coordinator's finish is not sent back (None on every rank)."""
    coordinator = group.rank == 0
    error, plan, metadata = None, None, None
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

    def global_step(all_plans: list) -> list:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(all_plans)
        plans = writer.prepare_global_plan(plans)
        if len(plans) != group.size:
            raise ValueError(f"create_global_plan/prepare_global_plan returned {len(plans)} plans for "
                             f"{group.size} ranks: one plan per rank, in rank order")
        return [_kept(mine, p) for mine, p in zip(all_plans, plans)] if filtering else plans

    filtering = _hooks_are(planner, writer, _SAVE_FILTER)
    central = _reduce_scatter(group, "planning", error, plan, global_step)
    if filtering and not isinstance(central, SavePlan):
        central = SavePlan([plan.items[i] for i in central["kept"]], plan.storage_data, plan.planner_data, plan.usable)
    results = None
    try:
        results = wait(writer.write_data(planner.finish_plan(central), planner))
    except Exception as e:  # noqa: BLE001
        error = e

    def finish(all_results: list) -> list | None:
        writer.finish(metadata=metadata, results=all_results)
        return [metadata] * group.size if return_metadata else None

    return _reduce_scatter(group, "write", error, results, finish, outcome_only=not return_metadata)


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
    if _hooks_are(planner, reader, _LOAD_IDENTITY):  # the central plan is the local one
        _check(group, "load planning", error)
        central = plan
    else:
        central = _reduce_scatter(group, "load planning", error, plan,
                                  lambda plans: reader.prepare_global_plan(planner.create_global_plan(plans)))
    try:
        with torch.no_grad():
            wait(reader.read_data(planner.finish_plan(central), planner))
    except Exception as e:  # noqa: BLE001
        error = e
    _check(group, "read", error)
    # tensors were filled in place and values assigned into `expanded` (load_bytes), as torch's
    for k, member in members.items():
        member.load_state_dict(expanded[k])
    for k, v in expanded.items():
        if k not in members and not isinstance(v, Stateful):
            state_dict[k] = v
