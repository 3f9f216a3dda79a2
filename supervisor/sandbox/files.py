"""A container's files as the API shows them: copied in, listed, read out.

``container: {"type": "auto", "file_ids": [...]}`` copies uploaded files
(``/v1/files``) into the container's folder before the code runs, so the
code opens them by name (:func:`copy_in`). What the folder holds is listed
back in the shape of OpenAI's container files API (:func:`listing`), each
file under an id derived from its container and path, so the same file
keeps its id from one listing to the next without a table to keep.

The folder is the code's to change: every read here treats it as hostile.
Only regular files are listed or opened, never through a symlink (each
path part is opened with ``O_NOFOLLOW`` from the folder down), a name
already there (a file, a folder, a link the code made) is never written
through, and counts and sizes are bounded.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from supervisor.sandbox.containers import Container, ContainerError, scan
from supervisor.sandbox.init import WORK

FILE_ID_PREFIX = "cfile_"
_FILE_ID_HEX = 32
_COPY_CHUNK = 1 << 20

Source = Literal["user", "assistant"]


@dataclass(frozen=True)
class ContainerFile:
    """One regular file of a container, as ``GET /v1/containers/{id}/files`` lists it."""

    id: str
    container_id: str
    name: str  # relative to the container's folder, "/"-separated
    bytes: int
    created_at: int
    source: Source

    def to_object(self) -> dict[str, object]:
        """The SDK's ``FileListResponse`` (and ``FileRetrieveResponse``)."""
        return {"id": self.id, "object": "container.file", "bytes": self.bytes, "container_id": self.container_id,
                "created_at": self.created_at, "path": f"{WORK}/{self.name}", "source": self.source}


def file_id(container_id: str, name: str) -> str:
    """The id of the file ``name`` in a container: the same for the same
    path while the container lives, and naming nothing in another one."""
    digest = hashlib.sha256(f"{container_id}\0{name}".encode()).hexdigest()
    return FILE_ID_PREFIX + digest[:_FILE_ID_HEX]


def valid_file_id(value: str) -> bool:
    body = value[len(FILE_ID_PREFIX):]
    return (value.startswith(FILE_ID_PREFIX) and len(body) == _FILE_ID_HEX
            and all(c in "0123456789abcdef" for c in body))


def listing(container: Container) -> tuple[list[ContainerFile], bool]:
    """The container's regular files, oldest first (then by name), and
    whether the scan stopped at its bound (``MAX_SCANNED_ENTRIES``)."""
    found, truncated = scan(container.path)
    files = [ContainerFile(file_id(container.id, name), container.id, name, size, mtime_ns // 1_000_000_000,
                           "user" if name in container.copied_in else "assistant")
             for name, (size, mtime_ns) in found.items()]
    files.sort(key=lambda f: (f.created_at, f.name))
    return files, truncated


def find(container: Container, wanted: str) -> ContainerFile:
    """The file whose id is ``wanted``; ContainerError when none is."""
    files, _ = listing(container)
    for info in files:
        if info.id == wanted:
            return info
    raise ContainerError(f"no file {wanted[:80]!r} in container {container.id}")


def copy_in(container: Container, sources: list[tuple[str, Path]], owner_ids: tuple[int, int] | None) -> list[str]:
    """Copy each (name, source path) into the container's folder, unless the
    name is taken there (a file the code changed is kept, and a link or
    folder it made under that name is never written through). Returns the
    names copied. ``owner_ids``: the (uid, gid) to give the copies (a
    service running as root runs the code as another user)."""
    copied = []
    for name, source in sources:
        try:
            fd = os.open(container.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                continue  # a link under that name: taken, as above
            raise
        try:
            with os.fdopen(fd, "wb") as out, source.open("rb") as src:
                while chunk := src.read(_COPY_CHUNK):
                    out.write(chunk)
                if owner_ids is not None:
                    os.fchown(out.fileno(), *owner_ids)
        except OSError:
            # A part of a file (a full disk) would keep its name and never be copied again.
            (container.path / name).unlink(missing_ok=True)
            raise
        container.copied_in.add(name)
        container.given_bytes += source.stat().st_size
        copied.append(name)
    return copied
