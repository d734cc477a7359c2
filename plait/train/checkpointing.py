"""Checkpoints of a training run through plait.checkpoint: save every N steps (async by default)
and at the end, resume from the latest complete one — also on another layout or world size.

    {folder}/step-000005/  (a plait.checkpoint directory; complete once metadata.json is committed)
    state: "model"  canonical FQN -> tensor/DTensor, merged over this rank's pipeline parts
           "optim"  the flat FQN-keyed optimizer state (flatten_optimizer_state_dict), merged alike
           "train"  step, the data stream's global position, which the new layout deals out again
           "config" the run's JobConfig as a dict (for `plait generate`; a resumed run keeps its own)

A resume continues the same run, so the model it builds must be the one saved: the saved config's
model (its shapes and hyper-parameters, model_fields) is compared with the current one before
anything loads, and a difference is refused naming the fields. Fine-tuning saved weights into a
changed model is a new run: `checkpoint.initial_load_path` names the checkpoint, read (when
`folder` has none to resume) for the model only by default (step 0, a fresh optimizer, schedule
and data stream; keys it lacks keep their init, a tensor saved in another shape is an error).
torchtitan's initial_load_path / initial_load_model_only, the same names.

Which checkpoint to resume is rank 0's choice, broadcast: every rank loads the same step even
when a commit lands while the ranks look (a node lost mid-save whose rank 0 still finishes it,
or a shared file system that shows a new directory to one node before another); a rank that
cannot see the chosen checkpoint complete stops every rank with the reason, before the load.

FQNs do not depend on the layout (stages keep `layers.{i}`, TP and FSDP keep names), so every
rank asks, on load, for exactly the keys its current parts hold, in their current placements,
and plait.checkpoint reads the overlapping pieces of whatever layout wrote them. The LR
schedulers hold no state beyond the step (their lambdas are the config's), set from "train".
"""

from __future__ import annotations

import re
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait import checkpoint as dcp
from plait import comm
from plait.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

_STEP_DIR = re.compile(r"^step-(\d+)$")
CONFIG_KEY = "app.config"  # TrainState's "config": one JSON value in the checkpoint
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _owner_fqn(key: str) -> str:
    """"state.layers.0.attention.wq.weight.exp_avg" -> "layers.0.attention.wq.weight"."""
    return key.split(".", 1)[1].rsplit(".", 1)[0]


class TrainState:
    """The run as a `Stateful` for plait.checkpoint.save / load."""

    def __init__(self, modules: list[nn.Module], optimizers: list, schedulers: list, stream: Any,
                 config: dict | None = None) -> None:
        self.modules, self.optimizers, self.schedulers, self.stream = modules, optimizers, schedulers, stream
        self.config = config or {}  # saved for `plait generate` (JSON); not loaded back
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for module, opt in zip(self.modules, self.optimizers):
            m, o = get_state_dict(module, opt, options=OPTIONS)
            model.update(m)
            optim.update(o)
        return {"model": model, "optim": optim, "train": {"step": self.step, "data": self.stream.state_dict()},
                "config": self.config}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for module, opt in zip(self.modules, self.optimizers):
            own = {n for n, _ in module.named_parameters()}
            mine, _ = get_state_dict(module, opt, options=OPTIONS)
            model = {k: state["model"][k] for k in mine}
            optim = {k: v for k, v in state["optim"].items() if _owner_fqn(k) in own or _canonical(k, own)}
            set_state_dict(module, opt, model_state_dict=model, optim_state_dict=optim, options=OPTIONS)
        self.step = int(state["train"]["step"])
        self.stream.load_state_dict(state["train"]["data"])
        for sched, opt in zip(self.schedulers, self.optimizers):
            sched.last_epoch = self.step
            sched._last_lr = [g["lr"] for g in opt.param_groups]


class ModelOnly:
    """The model's tensors of a TrainState as a `Stateful`: what a model-only initial load reads."""

    def __init__(self, state: TrainState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        for module in self.state.modules:
            model.update(get_model_state_dict(module, options=OPTIONS))
        return {"model": model}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for module in self.state.modules:
            mine = get_model_state_dict(module, options=OPTIONS)
            set_model_state_dict(module, {k: state["model"][k] for k in mine}, options=OPTIONS)


def model_fields(config) -> dict[str, object]:
    """What makes two runs' models the same (config field -> value, the name's defaults
    resolved): every parameter's shape and the function they compute. Not max_seq_len (the
    rope cache is rebuilt, never saved)."""
    from plait.train.layout import model_args

    a = model_args(config)
    return {"model.dim": a.dim, "model.n_layers": a.n_layers, "model.n_heads": a.n_heads,
            "model.n_kv_heads": a.kv_heads, "model.ffn_dim": a.ffn_hidden_dim(),
            "model.tie_embeddings": a.tie_embeddings, "vocab_size (data.tokenizer, data.vocab_size)": a.vocab_size,
            f"norm_eps (model.name {config.model.name!r})": a.norm_eps,
            f"rope_theta (model.name {config.model.name!r})": a.rope_theta}


def model_changes(path: str | Path, config) -> list[str]:
    """The model fields in which `config` differs from the config saved in checkpoint `path`
    ("model.ffn_dim: 192 saved, 256 now"); [] for a checkpoint saved without its config (load's
    own checks, keys and shapes, then stand alone)."""
    from plait.checkpoint.values import decode
    from plait.train.config import from_dict

    md = dcp.FileSystemReader(str(path)).read_metadata()
    if CONFIG_KEY not in md.values:
        return []
    try:
        saved = decode(md.values[CONFIG_KEY])
        before = model_fields(from_dict({k: saved[k] for k in ("model", "data") if k in saved}))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"the model config saved in {path} does not read back: {e}") from None
    now = model_fields(config)
    return [f"{k}: {before[k]} saved, {now[k]} now" for k in now if before[k] != now[k]]


def refuse_changed_model(path: str | Path, config) -> None:
    changes = model_changes(path, config)
    if changes:
        raise ValueError(f"checkpoint {path} holds another model than this run's: {'; '.join(changes)}. "
                         "Resume with the model config it was saved with, or fine-tune its weights into the "
                         "changed model as a new run: another checkpoint.folder with "
                         f"--checkpoint.initial_load_path {path} (the model only, from step 0)")


def check_resume(config) -> None:
    """The model check of the checkpoint this run would resume (as this process sees the folder),
    before any process group starts: a changed model is one line, not a traceback per rank.
    train() checks again the checkpoint the ranks agree on."""
    ck = config.checkpoint
    found = latest_complete(ck.folder or Path(config.job.dir) / "checkpoints") if ck.enabled and ck.resume else None
    if found is not None:
        refuse_changed_model(found[1], config)
    elif ck.initial_load_path and not ck.initial_load_model_only:
        refuse_changed_model(ck.initial_load_path, config)


def _canonical(key: str, own: set[str]) -> bool:
    # named_parameters of an FSDP-wrapped or compiled module may carry wrapper prefixes that the
    # state dict drops; compare on the canonical name too
    fqn = _owner_fqn(key)
    return any(n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "") == fqn for n in own)


def step_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:06d}"


def latest_complete(folder: str | Path) -> tuple[int, Path] | None:
    """The highest step whose checkpoint is complete (plait.checkpoint's commit), or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    from plait.checkpoint.commit import status

    steps = sorted(((int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.match(p.name))),
                   reverse=True)
    for step, path in steps:
        if status(str(path)) is None:
            return step, path
    return None


def agreed_latest(folder: str | Path, *, group) -> tuple[int, Path] | None:
    """`latest_complete(folder)` as rank 0 of `group` sees it, the same on every rank; raises on
    every rank (before any load) if some rank cannot see that checkpoint complete."""
    from plait.checkpoint.commit import status

    found = latest_complete(folder) if comm.get_rank(group) == 0 else None
    dev = comm.group_device(group)
    step = torch.tensor(found[0] if found is not None else -1, dtype=torch.int64, device=dev)
    comm.broadcast(step, src=0, group=group)
    if int(step) < 0:
        return None
    path = step_dir(folder, int(step))
    why = status(str(path))
    rank, size = comm.get_rank(group), comm.get_world_size(group)
    count = torch.tensor(0 if why is None else 1, dtype=torch.int64, device=dev)
    first = torch.tensor(size if why is None else rank, dtype=torch.int64, device=dev)
    comm.all_reduce(count, group=group)  # how many ranks cannot see it
    comm.all_reduce(first, group=group, op="min")  # the first of them
    if int(count):
        raise RuntimeError(f"rank 0 resumes {path}, but {int(count)} of {size} ranks (the first: "
                           f"rank {int(first)}) do not see it complete"
                           + (f" (here: {why})" if why else "")
                           + "; every rank must see the same checkpoint folder (a shared file system)")
    return int(step), path


class Checkpointer:
    """Saves (async or not) and prunes; one in flight at a time (async_save waits for the last)."""

    def __init__(self, folder: str | Path, *, async_mode: bool, keep_latest_k: int, is_rank0: bool) -> None:
        self.folder, self.async_mode, self.keep, self.is_rank0 = Path(folder), async_mode, keep_latest_k, is_rank0
        self._pending: Future | None = None
        self._pending_step = 0

    def save(self, state: TrainState, step: int, *, final: bool = False) -> Path:
        state.step = step
        path = step_dir(self.folder, step)
        if self.async_mode and not final:
            self._pending = dcp.async_save({"app": state}, checkpoint_id=str(path))
            self._pending_step = step
        else:
            self.wait()
            dcp.save({"app": state}, checkpoint_id=str(path))
            self._prune(step)
        return path

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._prune(self._pending_step)

    def _prune(self, saved: int) -> None:
        """Keep the k latest complete checkpoints up to `saved`, the one this run has just
        committed; never one after it (not this run's to remove)."""
        if not self.is_rank0 or self.keep <= 0:
            return
        done = sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _STEP_DIR.match(p.name))
                      and int(m.group(1)) <= saved and (p / "metadata.json").exists())
        for step in done[: -self.keep]:
            shutil.rmtree(step_dir(self.folder, step), ignore_errors=True)


def load(state: TrainState, path: Path, *, config, model_only: bool = False) -> int:
    """Load checkpoint `path` into `state`; the step it resumes at (0: model only). A whole
    load is a resume: refused, before anything loads, if `config`'s model is not the saved one."""
    if model_only:  # a new run from these weights: keys they lack keep their init (warned)
        mine = ModelOnly(state).state_dict()["model"]
        saved = dcp.FileSystemReader(str(path)).read_metadata().tensors
        if mine and not any(f"app.model.{k}" in saved for k in mine):  # else it would train from scratch, silently
            raise ValueError(f"checkpoint {path} holds none of this model's {len(mine)} tensors (no "
                             f"'app.model.{next(iter(mine))}'): is it a `plait train` checkpoint?")
        dcp.load({"app": ModelOnly(state)}, checkpoint_id=str(path),
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        return 0
    refuse_changed_model(path, config)
    # a pipeline rank asks only for its stages' keys: the others' are in the checkpoint too
    dcp.load({"app": state}, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return state.step


def export_safetensors(state: TrainState, out: Path) -> None:
    """The model in the Hugging Face layout in `out` (model-0000k-of-0000n.safetensors +
    model.safetensors.index.json). Collective: every rank writes the tensors (or pieces of
    them) it owns in place, so no rank gathers the model; any layout gives the same files."""
    model = state.state_dict()["model"]
    dcp.save(model, storage_writer=dcp.HuggingFaceStorageWriter(str(out)), process_group=comm.world_group())
