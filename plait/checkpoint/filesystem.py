"""torch.distributed.checkpoint.filesystem: the module path of the file-system storage layer
(plait.checkpoint.storage's FileSystemWriter and FileSystemReader)."""

from plait.checkpoint.storage import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
