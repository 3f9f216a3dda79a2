"""Containers: a folder of files that code runs in, one run at a time.

``container: {"type": "auto"}`` makes one (:meth:`ContainerPool.create`);
its id (``cntr_...``) names it in later calls. Files are uploaded into it
and the files a run writes are listed back (name and size; the bytes on
request, bounded). A container idle for ``idle_s`` expires: its folder is
removed. The pool holds at most ``max_containers``; a full pool removes the
least recently used container not running code to make room, and refuses a
new one (:class:`PoolFull`) only when every one is running code.

The parent reads what the code wrote as untrusted: only regular files, never
through a symlink (``O_NOFOLLOW``, ``lstat``), bounded in number and size,
so a link to the state dir or a huge file gives nothing away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from supervisor.sandbox.runner import RunResult, SandboxLimits, SandboxSpec, run_code

log = logging.getLogger(__name__)

MAX_FILE_NAME = 255
MAX_LISTED_FILES = 64
MAX_SCANNED_ENTRIES = 4096
# Uploads being written, in the pool's root beside the containers' folders.
SPOOL_PREFIX = "upload_"


class ContainerError(Exception):
    """A caller's mistake: the message is safe to show them."""


class PoolFull(ContainerError):
    pass


class UnknownContainer(ContainerError):
    pass


class NameTaken(ContainerError):
    pass


class UploadTooLarge(ContainerError):
    pass


@dataclass(frozen=True)
class FileInfo:
    name: str  # relative to the container's folder, "/"-separated
    bytes: int


@dataclass(frozen=True)
class CodeRun:
    result: RunResult
    # Files the run created or changed (bounded by MAX_LISTED_FILES).
    files: list[FileInfo]
    files_truncated: bool


def check_name(name: str) -> str:
    """A file name for an upload: a plain name, no folders."""
    if not name or len(name.encode()) > MAX_FILE_NAME or "/" in name or "\0" in name or name in (".", ".."):
        raise ContainerError(f"invalid file name {name[:80]!r}: a plain name of at most {MAX_FILE_NAME} bytes")
    return name


@dataclass
class Container:
    id: str
    path: Path
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The API key that made it (None: the admin, or a service with no keys):
    # only that key (and the admin) may run code in it.
    owner: str | None = None
    # Names of the files copied in from /v1/files or uploaded (listed with source "user").
    copied_in: set[str] = field(default_factory=set)
    # What POST /v1/containers gave it: a name, its own idle time before it
    # expires (None: the pool's), a memory limit for its runs (None: the pool's).
    name: str = ""
    idle_s: float | None = None
    memory_mib: int | None = None
    # Wall-clock second it was made, for the API (last_used is the pool's clock).
    created_at: int = 0
    # Bytes put in through the API and file_ids: bounded by the pool's max_upload_bytes.
    given_bytes: int = 0

    def usable_by(self, scope: str | None) -> bool:
        return scope is None or self.owner == scope

    def files(self) -> tuple[list[FileInfo], bool]:
        """Regular files under the folder (no symlink followed), bounded;
        True when there were more."""
        found, truncated = scan(self.path)
        return [FileInfo(name, size) for name, (size, _) in sorted(found.items())], truncated

    def _parent(self, name: str) -> tuple[int, str]:
        """(an open descriptor of the folder holding ``name``, its last part):
        ``name`` is relative and "/"-separated, and each folder on the way is
        opened without following a link. ContainerError for a name with an
        empty, "." or ".." part, or a folder on the way that is not there."""
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ContainerError(f"invalid file name {name[:80]!r}")
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts[:-1]:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except OSError as exc:
            os.close(fd)
            raise ContainerError(f"no file {name[:80]!r} in container {self.id}") from exc
        return fd, parts[-1]

    def unlink(self, name: str) -> None:
        """Remove the file ``name`` (relative, "/"-separated): each folder on
        the way opened without following a link; the last part is unlinked
        itself (a link the code made there is removed, not what it points at)."""
        fd, last = self._parent(name)
        try:
            os.unlink(last, dir_fd=fd)
        except OSError as exc:
            raise ContainerError(f"no file {name[:80]!r} in container {self.id}") from exc
        finally:
            os.close(fd)
        self.copied_in.discard(name)

    def open(self, name: str, max_bytes: int) -> tuple[BinaryIO, int]:
        """(the open file, its size) of the regular file ``name``: each folder
        on the way opened without following a link, the file too; refused
        when it is not a regular file, is out of the folder or is over
        ``max_bytes``. The caller closes it."""
        fd, last = self._parent(name)
        try:
            # O_NONBLOCK: a FIFO the code made opens at once (and is refused below) instead of waiting for a writer.
            file_fd = os.open(last, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            raise ContainerError(f"no file {name[:80]!r} in container {self.id}") from exc
        finally:
            os.close(fd)
        # Checked on the bare descriptor: fdopen itself refuses a folder with an OSError of its own.
        try:
            st = os.fstat(file_fd)
            if not stat.S_ISREG(st.st_mode):
                raise ContainerError(f"{name[:80]!r} is not a regular file")
            if st.st_size > max_bytes:
                raise ContainerError(f"{name[:80]!r} is {st.st_size} bytes, over {max_bytes}")
        except BaseException:
            os.close(file_fd)
            raise
        return os.fdopen(file_fd, "rb"), st.st_size

    def read(self, name: str, max_bytes: int) -> bytes:
        """A file's bytes, as :meth:`open` finds it (at most ``max_bytes``)."""
        f, _ = self.open(name, max_bytes)
        with f:
            return f.read(max_bytes + 1)[:max_bytes]


class ContainerPool:
    """The containers of one service; the clock is injected for tests."""

    def __init__(self, root: Path, spec: SandboxSpec, *, max_containers: int = 16, idle_s: float = 1200.0,
                 max_upload_bytes: int = 64 << 20, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.root = root
        self.spec = spec
        self.max_containers = max_containers
        self.idle_s = idle_s
        self.max_upload_bytes = max_upload_bytes
        self._clock = clock
        self._wall = wall
        # In the order they were made: the API lists them so.
        self._containers: dict[str, Container] = {}

    def __len__(self) -> int:
        return len(self._containers)

    def owner_ids(self) -> tuple[int, int] | None:
        """The (uid, gid) the code runs as, when that is not the service's
        own: a service running as root runs it as spec.uid, which must be
        able to write its folder and the files put there."""
        return (self.spec.uid, self.spec.gid) if os.geteuid() == 0 else None

    def _own(self, path: Path) -> None:
        ids = self.owner_ids()
        if ids is not None:
            os.chown(path, *ids)

    def create(self, owner: str | None = None, *, name: str = "", idle_s: float | None = None,
               memory_mib: int | None = None) -> Container:
        """A new container of ``owner``; ``idle_s`` (at most the pool's) and
        ``memory_mib`` replace the pool's for it."""
        self.expire()
        if len(self._containers) >= self.max_containers:
            self._evict(owner)
        self.root.mkdir(parents=True, exist_ok=True)
        cid = "cntr_" + secrets.token_hex(16)
        path = self.root / cid
        path.mkdir(mode=0o700)
        self._own(path)
        container = Container(cid, path, self._clock(), owner=owner, name=name, idle_s=idle_s,
                              memory_mib=memory_mib, created_at=int(self._wall()))
        self._containers[cid] = container
        return container

    def _evict(self, owner: str | None) -> None:
        """Make room in a full pool for a container of ``owner``: remove the
        least recently used container that is not running code, whoever's it
        is. A busy lab fills the pool with containers of conversations that
        have moved on long before they expire; refusing a new conversation
        for them would stop work that can go on, while the one removed is
        the one least likely to be used again (its next call fails as an
        expired one does). An owner holding half the pool or more makes room
        from its own idle ones first, so one key making many cannot sweep
        away every other key's. PoolFull only when every container is
        running code."""
        idle = [c for c in self._containers.values() if not c.lock.locked()]
        if not idle:
            raise PoolFull(f"too many containers: all {self.max_containers} are running code; "
                           "try again when a run ends")
        held = sum(1 for c in self._containers.values() if c.owner == owner)
        own = [c for c in idle if c.owner == owner]
        victim = min(own if own and 2 * held >= self.max_containers else idle, key=lambda c: c.last_used)
        log.info("container pool full (%d): removed %s, idle %.0f s, the least recently used",
                 self.max_containers, victim.id, self._clock() - victim.last_used)
        self.remove(victim.id)

    def visible(self, scope: str | None) -> list[Container]:
        """The live containers ``scope`` may see, oldest first."""
        self.expire()
        return [c for c in self._containers.values() if c.usable_by(scope)]

    def last_active_at(self, container: Container) -> int:
        """The wall-clock second the container was last used."""
        return int(self._wall() - (self._clock() - container.last_used))

    def idle_s_of(self, container: Container) -> float:
        return self.idle_s if container.idle_s is None else container.idle_s

    def new_spool(self) -> tuple[Path, BinaryIO]:
        """A new, empty file in the pool's root (no container's folder) for an
        upload to be written to as it arrives; :meth:`take` moves it in.
        The caller removes it if it is not taken."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{SPOOL_PREFIX}{secrets.token_hex(16)}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        return path, os.fdopen(fd, "wb")

    def take(self, container: Container, name: str, spool: Path, size: int) -> None:
        """Move the uploaded file ``spool`` (in the pool's root, the same
        file system) into the container as ``name``, at once: a hard link
        never replaces a name already there (a file, a folder, a link the
        code made), and a run never sees half a file. ContainerError when
        the name is taken or the container's uploads would pass
        ``max_upload_bytes``."""
        check_name(name)
        if container.given_bytes + size > self.max_upload_bytes:
            raise UploadTooLarge(f"container {container.id} would take in {container.given_bytes + size} bytes "
                                 f"of files, over the limit of {self.max_upload_bytes}")
        self._own(spool)
        try:
            os.link(spool, container.path / name, follow_symlinks=False)
        except FileExistsError as exc:
            raise NameTaken(f"a file named {name[:80]!r} is in container {container.id} already") from exc
        except FileNotFoundError as exc:
            # Deleted (or expired) while the upload arrived.
            raise UnknownContainer(f"no container {container.id} (it was deleted or expired)") from exc
        container.given_bytes += size
        container.copied_in.add(name)
        container.last_used = self._clock()

    def get(self, cid: str, scope: str | None = None) -> Container:
        """The container ``cid``, if the caller ``scope`` may use it (another
        key's container is unknown to it, as if it did not exist)."""
        container = self._containers.get(cid)
        if container is None or not container.usable_by(scope):
            raise UnknownContainer(f"no container {cid[:80]!r} (it may have expired)")
        container.last_used = self._clock()
        return container

    def upload(self, container: Container, name: str, data: bytes) -> FileInfo:
        check_name(name)
        if len(data) > self.max_upload_bytes:
            raise ContainerError(f"file {name!r} is {len(data)} bytes, over the limit of {self.max_upload_bytes}")
        fd = os.open(container.path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        self._own(container.path / name)
        container.last_used = self._clock()
        return FileInfo(name, len(data))

    async def run(self, container: Container, code: str, limits: SandboxLimits | None = None) -> CodeRun:
        """Run ``code`` in the container (one run at a time); ``limits``
        replace the pool's for this run."""
        spec = self.spec if limits is None else replace(self.spec, limits=limits)
        async with container.lock:
            before, _ = scan(container.path)
            result = await run_code(spec, container.path, code)
            container.last_used = self._clock()
            after, truncated = scan(container.path)
            changed = [FileInfo(name, size) for name, (size, mtime) in sorted(after.items())
                       if before.get(name) != (size, mtime)]
            if len(changed) > MAX_LISTED_FILES:
                changed, truncated = changed[:MAX_LISTED_FILES], True
            return CodeRun(result, changed, truncated)

    def expire(self, now: float | None = None) -> list[str]:
        """Remove the containers idle for ``idle_s`` (not one running code)."""
        now = self._clock() if now is None else now
        gone = [c for c in self._containers.values()
                if now - c.last_used >= self.idle_s_of(c) and not c.lock.locked()]
        for container in gone:
            self.remove(container.id)
        return [c.id for c in gone]

    def remove(self, cid: str) -> None:
        container = self.detach(cid)
        if container is not None:
            remove_tree(container.path)

    def detach(self, cid: str) -> Container | None:
        """Take the container out of the pool (no one finds it any more); the
        caller removes its folder, perhaps in a thread."""
        return self._containers.pop(cid, None)

    def close(self) -> None:
        for cid in list(self._containers):
            self.remove(cid)


def scan(root: Path) -> tuple[dict[str, tuple[int, int]], bool]:
    """{relative name: (size, mtime_ns)} of the regular files under root,
    walked without following a link, at most MAX_SCANNED_ENTRIES entries."""
    found: dict[str, tuple[int, int]] = {}
    scanned = 0
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            # A folder the code made unreadable: its files are not listed.
            continue
        for entry in entries:
            scanned += 1
            if scanned > MAX_SCANNED_ENTRIES:
                return found, True
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append(Path(entry.path))
            elif stat.S_ISREG(st.st_mode):
                found[Path(entry.path).relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
    return found, False


def remove_tree(path: Path) -> None:
    """rmtree, also where the code took the permissions off a folder."""
    def give_back(func: Callable[[str], object], failed: str, _info: object) -> None:
        os.chmod(os.path.dirname(failed), 0o700)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, 0o700)
            shutil.rmtree(failed)
        else:
            func(failed)
    shutil.rmtree(path, onerror=give_back)
