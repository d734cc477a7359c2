"""plait.checkpoint — sharded save/load that reshards: torch.distributed.checkpoint's API.

    save({"app": AppState(model, optim)}, checkpoint_id="ckpt/step_100")   # every rank writes its own
    load({"app": AppState(model, optim)}, checkpoint_id="ckpt/step_100")   # any layout -> any layout
    fut = async_save(state, checkpoint_id=...); ...; fut.result()          # blocks only to stage

A checkpoint is a directory: one safetensors file per rank (per writer thread) holding the
chunks that rank owns, and metadata.json (global shape, dtype and chunks of every tensor,
with byte ranges and crc32; the non-tensor values), written last and committed by an atomic
rename. Data flow: planner.py (who writes what, who reads what) -> storage.py and
safetensors_io.py (bytes, checksums) -> commit.py (atomicity); saver.py, loader.py and
async_saver.py drive them over the process group (group.py); tools.py and dcp_import.py
are `plait checkpoint ...`. (Modules are not named save/load/async_save: those names are
the functions.)
"""

from plait.checkpoint import format_utils
from plait.checkpoint.async_saver import async_save
from plait.checkpoint.deprecated import load_state_dict, save_state_dict
from plait.checkpoint.group import CheckpointError
from plait.checkpoint.loader import load
from plait.checkpoint.metadata import ChunkMeta, CorruptCheckpointError, Metadata, TensorMeta
from plait.checkpoint.planner import DefaultLoadPlanner, DefaultSavePlanner
from plait.checkpoint.safetensors_io import ChunkError
from plait.checkpoint.saver import save
from plait.checkpoint.stateful import Stateful
from plait.checkpoint.storage import FileSystemReader, FileSystemWriter

__all__ = [
    "CheckpointError", "ChunkError", "ChunkMeta", "DefaultLoadPlanner", "DefaultSavePlanner",
    "FileSystemReader", "FileSystemWriter", "Metadata", "Stateful", "TensorMeta", "async_save",
    "load", "save",
]
# integrity (every byte under a checksum), torch's format utilities and deprecated names
__all__ += ["CorruptCheckpointError", "format_utils", "load_state_dict", "save_state_dict"]
