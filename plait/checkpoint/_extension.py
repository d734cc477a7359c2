"""plait.checkpoint._extension — torch's checkpoint extension types
(torch.distributed.checkpoint._extension), by name, shape and meaning.

    Extension                 registry_name() / from_descriptor(version) / get_descriptor()
    StreamTransformExtension  transform_to(writable) -> writable, transform_from(readable) -> readable
    ZStandard                 "stream.zstd/1", when the zstandard package is installed
    ExtensionRegistry         descriptor "name[@domain]/version" -> an Extension instance

A descriptor is what a writer records per file so that a reader can rebuild the same
transform chain; the registry maps its name to the class. plait's own writer records its
format in its metadata and takes no extensions yet: these are the types that torch's
callers subclass, register and look up.
"""

from __future__ import annotations

import abc
import importlib.util
from collections.abc import Sequence
from typing import IO


class Extension(abc.ABC):
    """A modular addition to checkpointing that changes what is written; it describes itself
    by a descriptor string, from which the registry rebuilds it at read time."""

    @staticmethod
    @abc.abstractmethod
    def registry_name() -> str:
        """The name the registry knows this class by."""

    @staticmethod
    @abc.abstractmethod
    def from_descriptor(version: str) -> Extension:
        """The instance a descriptor of this class with `version` stands for."""

    @abc.abstractmethod
    def get_descriptor(self) -> str:
        """"name[@local-domain][/version]", recorded with what this extension wrote."""


class StreamTransformExtension(Extension):
    """A transform of a byte stream (compression, encryption), applied chunk by chunk."""

    @abc.abstractmethod
    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        """A writable stream whose bytes reach `output` transformed."""

    @abc.abstractmethod
    def transform_from(self, input: IO[bytes]) -> IO[bytes]:  # noqa: A002 - torch's name
        """A readable stream of `input`'s bytes with the transform undone."""


class ZStandard(StreamTransformExtension):
    """Zstandard compression through the `zstandard` package (torch's "stream.zstd/1")."""

    @staticmethod
    def is_available() -> bool:
        return importlib.util.find_spec("zstandard") is not None

    @staticmethod
    def registry_name() -> str:
        return "stream.zstd"

    @staticmethod
    def from_descriptor(version: str) -> ZStandard:
        if version.partition(".")[0] != "1":
            raise ValueError(f"Unknown extension version={version!r} of stream.zstd (knows 1)")
        return ZStandard()

    def __init__(self) -> None:
        if not ZStandard.is_available():
            raise ValueError("ZStandard extension is unavailable because no module named 'zstandard'")

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        import zstandard

        return zstandard.ZstdCompressor().stream_writer(output)

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:  # noqa: A002 - torch's name
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(input)


class ExtensionRegistry:
    """Descriptor names -> Extension classes; ZStandard is registered from the start."""

    def __init__(self) -> None:
        self.extensions: dict[str, type[Extension]] = {ZStandard.registry_name(): ZStandard}

    def register(self, cls: type[Extension]) -> None:
        self.extensions[cls.registry_name()] = cls

    def from_descriptor_list(self, descriptors: Sequence[str]) -> Sequence[Extension]:
        """One instance per descriptor, each from its class's from_descriptor(version)."""
        out = []
        for desc in descriptors:
            name, _, version = desc.partition("/")
            cls = self.extensions.get(name)
            if cls is None:
                raise ValueError(f"Unknown extension name={name!r} (descriptor {desc!r}); registered: "
                                 f"{sorted(self.extensions)}")
            out.append(cls.from_descriptor(version))
        return out


__all__ = ["Extension", "ExtensionRegistry", "StreamTransformExtension", "ZStandard"]
