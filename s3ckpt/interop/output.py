"""Where exported files go: a local folder or an S3 prefix, each file written front to back.

The exporter writes every file sequentially as tensors arrive, so an output only needs
"open a file, append bytes, close it". A local file is an ordinary file; a file under an
``s3://`` prefix is a multipart upload whose parts are sent as they fill (one part in
memory), or one ``PutObject`` if it ends before its first part is full.

An output that already holds files is refused unless ``overwrite``; then the files of an
earlier export that this one did not rewrite are removed at the end (a model re-exported
into fewer shards leaves no stale shard). Anything else there is left alone. A failed
export removes what it wrote.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Protocol

from s3ckpt.config import S3URI, S3Config
from s3ckpt.errors import ConfigError, OutputExistsError, StorageError
from s3ckpt.s3.loop import io_loop
from s3ckpt.s3.store import ObjectStore
from s3ckpt.transfer.object_writer import PART_SIZE, ObjectWriter

# Names an export writes (interop.formats): what ``overwrite`` may remove when stale.
EXPORT_NAMES = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|pytorch_model\.bin)$"
)
log = logging.getLogger(__name__)


class Stream(Protocol):
    """One file being written front to back."""

    def write(self, data: memoryview | bytes) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None:
        """Give up on the file (its output removes it)."""
        ...


class Output(Protocol):
    """A folder or prefix receiving files (see the module docstring)."""

    written: list[str]  # names of the files opened so far

    def check(self, overwrite: bool) -> None: ...
    def open(self, name: str) -> Stream: ...
    def finish(self) -> None: ...
    def discard(self) -> None: ...


def open_output(out: str | os.PathLike[str], config: S3Config) -> Output:
    """The output ``out`` names: ``s3://bucket/prefix`` or a local folder."""
    text = os.fspath(out)
    if text.startswith("s3://"):
        return S3Output(S3URI.parse(text, require_prefix=False), config)
    return LocalOutput(Path(text))


class LocalOutput:
    """A local folder, created if absent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written: list[str] = []
        self._existing: list[str] = []

    def __str__(self) -> str:
        return str(self.path)

    def check(self, overwrite: bool) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise OutputExistsError(f"{self.path} exists and is not a folder")
        self._existing = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
        if self._existing and not overwrite:
            raise OutputExistsError(f"{self.path} exists and is not empty (pass --overwrite)")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {self.path}: {exc.strerror}") from exc

    def open(self, name: str) -> Stream:
        self.written.append(name)
        return _LocalStream(self.path / name)

    def finish(self) -> None:
        for name in _stale(self._existing, self.written):
            self.path.joinpath(name).unlink(missing_ok=True)

    def discard(self) -> None:
        for name in self.written:
            self.path.joinpath(name).unlink(missing_ok=True)


class S3Output:
    """An S3 prefix: each file one object, uploaded in parts as it is written."""

    def __init__(self, location: S3URI, config: S3Config) -> None:
        self.location = location
        self.store = ObjectStore(config, location.bucket)
        self.written: list[str] = []
        self._existing: list[str] = []
        self._open: list[ObjectWriter] = []

    def __str__(self) -> str:
        return str(self.location)

    def check(self, overwrite: bool) -> None:
        prefix = self.location.key("")
        io_loop().run(self.store.head_bucket())
        self._existing = io_loop().run(_names(self.store, prefix))
        if self._existing and not overwrite:
            raise OutputExistsError(f"{self.location} already holds objects (pass --overwrite)")

    def open(self, name: str) -> Stream:
        self.written.append(name)
        # ahead=0: a part uploaded before the next fills, so the export's window bounds memory
        stream = ObjectWriter(self.store, self.location.key(name), part_size=PART_SIZE, ahead=0)
        self._open.append(stream)
        return stream

    def finish(self) -> None:
        stale = [self.location.key(n) for n in _stale(self._existing, self.written)]
        if stale:
            io_loop().run(self.store.delete_many(stale))

    def discard(self) -> None:
        for stream in self._open:
            stream.abort()
        try:
            io_loop().run(self.store.delete_many([self.location.key(n) for n in self.written]))
        except StorageError as exc:
            log.warning("could not delete the partial export at %s: %s", self.location, exc)


async def _names(store: ObjectStore, prefix: str) -> list[str]:
    return [m.key[len(prefix) :] async for m in store.list(prefix)]


def _stale(existing: list[str], written: list[str]) -> list[str]:
    return [n for n in existing if EXPORT_NAMES.match(n) and n not in written]


class _LocalStream:
    """One local file written front to back."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("wb")

    def write(self, data: memoryview | bytes) -> None:
        self.file.write(data)

    def close(self) -> None:
        self.file.close()

    def abort(self) -> None:
        self.file.close()
