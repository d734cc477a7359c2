"""The trainer's configuration: dataclass sections, read from TOML, overridden from the command line.

    TOML file (or a shipped name: tiny, small, 100m) -> JobConfig sections
    -> `--section.key value` overrides (typed by the field; a bare `--section.flag` sets True)
    -> resolve(world_size): -1 dims become "the rest", every divisibility is checked here,
       before any process group exists, with the numbers in the message

Sections follow torchtitan's names where they exist (job, model, training, parallel,
activation_checkpoint, compile, data, metrics, checkpoint). `--print-config` prints the
resolved config as TOML, which loads back to the same config.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class Job:
    name: str = "plait"
    dir: str = "runs/plait"  # run folder: metrics.jsonl, checkpoints/, the BPE tokenizer cache
    seed: int = 0


@dataclass
class Model:
    name: str = "tiny"  # a plait.models.llama CONFIGS name; the fields below override it (0: keep)
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    ffn_dim: int = 0
    tie_embeddings: bool = False


@dataclass
class Training:
    steps: int = 100
    batch_size: int = 8  # global: sequences per step over all data-parallel ranks
    seq_len: int = 64
    lr: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio at the last step
    weight_decay: float = 0.1
    eps: float = 1e-8
    max_norm: float = 1.0  # gradient clipping over the whole (sharded) model; 0: off


@dataclass
class Parallel:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: the rest of the world
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: the sequence sharded over cp ranks, attention as a ring
    pp_schedule: str = "1F1B"  # a plait.pipelining schedule name, or a path to a CSV
    microbatches: int = 0  # 0: as many as pipeline stages
    virtual_stages: int = 1  # stages per pipeline rank (2 for interleaved and V schedules)
    pp_layers: list[int] = field(default_factory=list)  # layers per stage; empty: even split
    sequence_parallel: bool = True
    loss_parallel: bool = True
    auto: bool = False  # plait train: take plait plan's best layout for the world size (printed first)


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | every (every k-th block, k = `every`)
    every: int = 2


@dataclass
class Compile:
    enabled: bool = False  # torch.compile each block (after activation checkpointing, before FSDP)
    backend: str = "inductor"


@dataclass
class Data:
    corpus: str = "stdlib"  # the running Python's standard library sources; or "path"
    path: str = ""  # a text file or a folder of text files (sets corpus = "path")
    glob: str = "**/*.py"  # files taken from a folder corpus
    max_bytes: int = 0  # read at most this many bytes of the corpus (0: all)
    tokenizer: str = "byte"  # byte | bpe (the `tokenizers` package, trained on the corpus, cached)
    vocab_size: int = 1024  # BPE only; the byte tokenizer has 256
    val_fraction: float = 0.02  # every (1/val_fraction)-th window is held out


@dataclass
class Metrics:
    log_every: int = 1
    val_every: int = 0  # 0: validate at the end only
    val_batches: int = 2  # 0: no validation
    jsonl: str = ""  # default: {job.dir}/metrics.jsonl
    progress: bool = True  # a progress bar on rank 0 (tqdm)
    peak_flops: float = 0.0  # per rank, for MFU; 0: 1e12 on a GPU-less machine (see metrics.py)
    live_bytes: bool = False  # count peak live tensor bytes per rank in the first step (slow; plait plan --compare)


@dataclass
class Checkpoint:
    enabled: bool = False
    folder: str = ""  # default: {job.dir}/checkpoints
    interval: int = 0  # save every N steps (0: only at the end)
    async_mode: bool = True
    keep_latest_k: int = 0  # 0: keep all
    resume: bool = True  # start from the latest complete checkpoint in `folder` (its model config must be this one's)
    # a checkpoint (a step-N folder) this run starts from when `folder` has none to resume: a new
    # run from another's weights, e.g. fine-tuning them into a changed model (torchtitan's name)
    initial_load_path: str = ""
    # with initial_load_path: load the model only (step 0, a fresh optimizer, schedule and data;
    # the model may differ: keys the checkpoint lacks keep their init, a shape change is an error);
    # false: the whole training state, as a resume (the same model config)
    initial_load_model_only: bool = True
    export_safetensors: bool = False  # the model in the Hugging Face layout in {job.dir}/hf at the end


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallel: Parallel = field(default_factory=Parallel)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _field_types(section_cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(where: str, kind: object, value: object) -> object:
    """A TOML or command-line value as the field's type; a clear error otherwise."""
    origin = typing.get_origin(kind)
    if origin is list:
        if isinstance(value, str):
            value = [x for x in value.replace(" ", "").split(",") if x]
        if not isinstance(value, list):
            raise TypeError(f"{where} takes a list, got {value!r}")
        (inner,) = typing.get_args(kind)
        return [_coerce(where, inner, x) for x in value]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise TypeError(f"{where} takes true or false, got {value!r}")
    try:
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{where} takes {kind.__name__}, got {value!r}") from None
    return str(value)


def from_dict(data: dict, base: JobConfig | None = None) -> JobConfig:
    """A JobConfig from nested {section: {key: value}}, over `base` (default: the defaults)."""
    config = dataclasses.replace(base) if base is not None else JobConfig()
    sections = _sections()
    for name, values in data.items():
        if name not in sections:
            raise ValueError(f"unknown config section [{name}]; known: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise TypeError(f"[{name}] must be a table, got {values!r}")
        section = dataclasses.replace(getattr(config, name))
        types = _field_types(sections[name])
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in types:
                raise ValueError(f"unknown key {name}.{key}; [{name}] has {', '.join(types)}")
            setattr(section, key, _coerce(f"{name}.{key}", types[key], value))
        setattr(config, name, section)
    return config


def load(path_or_name: str | Path) -> JobConfig:
    """A TOML file, or the name of a shipped config (tiny, small, 100m)."""
    path = Path(path_or_name)
    if not path.exists():
        shipped = CONFIG_DIR / f"{path_or_name}.toml"
        if not shipped.exists():
            names = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
            raise ValueError(f"no config file {str(path_or_name)!r} and no shipped config of that name; "
                             f"shipped: {', '.join(names)}")
        path = shipped
    with open(path, "rb") as f:
        return from_dict(tomllib.load(f))


def apply_overrides(config: JobConfig, args: list[str]) -> JobConfig:
    """`--section.key value` pairs (or `--section.key=value`; a bare boolean flag is True)."""
    sections = _sections()
    updates: dict[str, dict[str, object]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ValueError(f"unexpected argument {arg!r}: overrides are --section.key value")
        key, eq, value = arg[2:].partition("=")
        section, _, name = key.partition(".")
        name = name.replace("-", "_")
        if section not in sections:
            raise ValueError(f"unknown config section in {arg!r}; known: {', '.join(sections)}")
        kind = _field_types(sections[section]).get(name)
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if kind is bool and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None:
                raise ValueError(f"{arg} needs a value")
            else:
                value, i = nxt, i + 1
        updates.setdefault(section, {})[name] = value
        i += 1
    return from_dict(updates, config)
