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
are `plait checkpoint ...`. torch's planner and storage interfaces are planner_api.py and
storage_api.py; a custom planner or storage layer is driven through them by driver.py;
hf_storage.py / hf_reader.py write and read the Hugging Face layout on them (hf_shards.py:
torch's per-rank shard files). (Modules are not named
save/load/async_save: those names are the functions.)
"""

from plait.checkpoint import format_utils
from plait.checkpoint.async_saver import async_save
from plait.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from plait.checkpoint.deprecated import load_state_dict, save_state_dict
from plait.checkpoint.group import CheckpointError
from plait.checkpoint.hf_reader import HuggingFaceStorageReader
from plait.checkpoint.hf_storage import HuggingFaceStorageWriter
from plait.checkpoint.loader import load
from plait.checkpoint.metadata import ChunkMeta, CorruptCheckpointError, TensorMeta
from plait.checkpoint.planner_api import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    ReadItem,
    SavePlan,
    SavePlanner,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    WriteItem,
    WriteItemType,
)
from plait.checkpoint.safetensors_io import ChunkError
from plait.checkpoint.saver import save
from plait.checkpoint.stateful import Stateful
from plait.checkpoint.storage import FileSystemReader, FileSystemWriter
from plait.checkpoint.storage_api import (
    CheckpointException,
    StorageReader,
    StorageWriter,
    WriteResult,
)

__all__ = [
    "CheckpointError", "ChunkError", "ChunkMeta", "DefaultLoadPlanner", "DefaultSavePlanner",
    "FileSystemReader", "FileSystemWriter", "Metadata", "Stateful", "TensorMeta", "async_save",
    "load", "save",
    # torch's extension points (planner_api, storage_api, default_planner) and Hugging Face storage
    "BytesStorageMetadata", "CheckpointException", "ChunkStorageMetadata", "LoadItemType", "LoadPlan",
    "LoadPlanner", "MetadataIndex", "ReadItem", "SavePlan", "SavePlanner", "StorageMeta", "StorageReader",
    "StorageWriter", "TensorProperties", "TensorStorageMetadata", "WriteItem", "WriteItemType", "WriteResult",
    "HuggingFaceStorageReader", "HuggingFaceStorageWriter",
]
# integrity (every byte under a checksum), torch's format utilities and deprecated names
__all__ += ["CorruptCheckpointError", "format_utils", "load_state_dict", "save_state_dict"]
