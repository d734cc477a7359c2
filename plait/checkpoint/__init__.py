"""plait.checkpoint — sharded save/load that reshards: torch.distributed.checkpoint's API.

    save({"app": AppState(model, optim)}, checkpoint_id="ckpt/step_100")   # every rank writes its own
    load({"app": AppState(model, optim)}, checkpoint_id="ckpt/step_100")   # any layout -> any layout
    fut = async_save(state, checkpoint_id=...); ...; fut.result()          # blocks only to stage

A checkpoint is a directory: one safetensors file per rank (per writer thread) holding the
chunks that rank owns, and metadata.json (global shape, dtype and chunks of every tensor,
with byte ranges and crc32; the non-tensor values), written last and committed by an atomic
rename. Data flow: planner.py (who writes what, who reads what) -> storage.py and
safetensors_io.py (bytes, checksums) -> commit.py (atomicity); save.py, load.py and
async_save.py drive them over the process group (group.py).
"""

from plait.checkpoint.async_save import async_save
from plait.checkpoint.group import CheckpointError
from plait.checkpoint.load import load
from plait.checkpoint.metadata import ChunkMeta, Metadata, TensorMeta
from plait.checkpoint.planner import DefaultLoadPlanner, DefaultSavePlanner
from plait.checkpoint.safetensors_io import ChunkError
from plait.checkpoint.save import save
from plait.checkpoint.stateful import Stateful
from plait.checkpoint.storage import FileSystemReader, FileSystemWriter

__all__ = [
    "CheckpointError", "ChunkError", "ChunkMeta", "DefaultLoadPlanner", "DefaultSavePlanner",
    "FileSystemReader", "FileSystemWriter", "Metadata", "Stateful", "TensorMeta", "async_save",
    "load", "save",
]
