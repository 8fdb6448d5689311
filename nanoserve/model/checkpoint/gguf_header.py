"""The head of a GGUF file read without parsing the rest: its magic, version and architecture.

A GGUF file starts with the magic `GGUF`, a version, the tensor and key counts, then its key/value
pairs; converters write `general.architecture` first and the vocabulary (the bulk of the metadata)
later. `architecture` reads pairs only until it finds that key, so a file whose architecture is
refused is refused before its vocabulary is read.

Invariants: nothing past the architecture's value is read unless keys come before it (each is
skipped by its declared size); a file that is not GGUF, of a version other than `VERSIONS`, or
ending inside the pairs raises `ModelLoadError` with one line naming the file and what is wrong.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

from gguf import GGUFValueType

from nanoserve.model.config import ModelLoadError

MAGIC = b"GGUF"
ARCHITECTURE_KEY = "general.architecture"
VERSIONS = (2, 3)  # what the gguf package reads; version 1 counted in 32 bits
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


class _Cursor:
    """Sequential reads of one file in its byte order; reading past the end raises ModelLoadError."""

    def __init__(self, f: BinaryIO, name: str) -> None:
        self.f, self.name, self.order = f, name, "<"

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) < n:
            raise ModelLoadError(f"{self.name}: truncated: the metadata ends past the file")
        return data

    def skip(self, n: int) -> None:
        here = self.f.tell()
        if here + n > os.fstat(self.f.fileno()).st_size:
            raise ModelLoadError(f"{self.name}: truncated: the metadata ends past the file")
        self.f.seek(here + n)

    def unpack(self, fmt: str) -> int:
        value: int = struct.unpack(self.order + fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def string(self) -> bytes:
        return self.take(self.unpack("Q"))

    def skip_value(self, kind: int) -> None:
        if kind == GGUFValueType.STRING:
            self.skip(self.unpack("Q"))
        elif kind == GGUFValueType.ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _SCALAR_FORMATS:
                self.skip(count * struct.calcsize(_SCALAR_FORMATS[GGUFValueType(item)]))
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _SCALAR_FORMATS:
            self.skip(struct.calcsize(_SCALAR_FORMATS[GGUFValueType(kind)]))
        else:
            raise ModelLoadError(f"{self.name}: not a valid GGUF file (metadata value of unknown type {kind})")


def architecture(path: str | Path) -> str | None:
    """The file's `general.architecture`, or None when it has none; raises ModelLoadError for a file
    that is not GGUF or ends before its key/value pairs do."""
    name = Path(path).name
    with open(path, "rb") as f:
        head = f.read(4)
        if head != MAGIC:
            raise ModelLoadError(f"{name}: not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
        cursor = _Cursor(f, name)
        version = cursor.unpack("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            cursor.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in VERSIONS:
            raise ModelLoadError(f"{name}: GGUF version {version}, which nanoserve does not read (it reads {VERSIONS})")
        cursor.take(8)  # tensor count
        for _ in range(cursor.unpack("Q")):
            key, kind = cursor.string(), cursor.unpack("I")
            if key == ARCHITECTURE_KEY.encode() and kind == GGUFValueType.STRING:
                return cursor.string().decode("utf-8", errors="replace")
            cursor.skip_value(kind)
    return None
