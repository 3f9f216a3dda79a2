"""The ``code_interpreter`` tool of one response: its container and its runs.

The model is offered one function, ``code_interpreter(code)``. A call runs
the code in the sandbox (supervisor/sandbox/) in the response's container:
the one the tool names (``container: "cntr_..."``), or with
``container: {"type": "auto"}`` the one an earlier call of the conversation
used while it lives, else a new one, made at the first call. Its logs (and
images) become the ``code_interpreter_call`` item's outputs, which the
model reads back. ``file_ids`` (uploads of the caller's key) are copied
into the container before its first run here; an answer naming a file the
code wrote there (in this response or an earlier one) cites it
(``container_file_citation``). Off until an admin enables it (``code_interpreter``) and
the sandbox works on this host; otherwise a request with the tool is a 400
that says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from supervisor.errors import BadRequest, NotFound, PayloadTooLarge
from supervisor.generation.pieces import ToolCall
from supervisor.generation.tools import (
    CodeInterpreterAuto,
    CodeInterpreterTool,
    FunctionTool,
)
from supervisor.knowledge.files import FileStore
from supervisor.knowledge.records import FILE_PREFIX, checked_id
from supervisor.responses.items import (
    CodeImage,
    CodeInterpreterCallItem,
    CodeLogs,
    Item,
    new_id,
)
from supervisor.sandbox.containers import (
    MAX_FILE_NAME,
    Container,
    ContainerError,
    ContainerPool,
)
from supervisor.sandbox.files import copy_in, file_id, listing
from supervisor.sandbox.init import WORK
from supervisor.sandbox.outputs import call_outputs, call_status

log = logging.getLogger(__name__)

# The function the model calls. Qwen-Agent and others name their Python tool
# so; "python" would clash with more clients' own functions.
CODE_FUNCTION = "code_interpreter"
DESCRIPTION = ("Run Python 3 code in a sandbox and read what it prints (stdout and stderr) back. "
               "The sandbox has no network. The working folder keeps its files from one call to the "
               "next in this conversation; images written there (.png, .jpg) are shown to the user. "
               "Print the values you need.")
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "The Python code to run."}},
    "required": ["code"],
    "additionalProperties": False,
}
# An image a run writes is stored in the response as a data URL: bounded so
# a few plots fit, not a folder of photos.
MAX_IMAGE_BYTES = 1 << 20
MEMORY_LIMITS_MIB = {"1g": 1024, "4g": 4096, "16g": 16384, "64g": 65536}
# Files a request may copy into its container (their bytes together are
# bounded by the pool's max_upload_bytes).
MAX_INPUT_FILES = 32
# The files an answer may cite: each is looked for in the answer's text.
MAX_CITED_FILES = 256
# What may stand before a file's name where an answer links it: the folder
# the code sees, with or without the "sandbox:" scheme OpenAI's models write.
_LINK_PREFIXES = (f"sandbox:{WORK}/", f"{WORK}/")


@dataclass
class Containers:
    """The service's code_interpreter: its containers, or why there are none."""

    pool: ContainerPool | None = None
    unavailable: str = "code_interpreter is not enabled (setting code_interpreter)"


def code_tools(tools: list[Any]) -> list[tuple[int, CodeInterpreterTool]]:
    return [(i, t) for i, t in enumerate(tools) if isinstance(t, CodeInterpreterTool)]


def refuse_code(tools: list[Any], containers: Containers, owner: str | None) -> None:
    """The 400s of a request's code_interpreter tool that need no database:
    off here, more than one, too many file_ids or a malformed one, a
    network policy, a container it may not use."""
    found = code_tools(tools)
    for n, (i, tool) in enumerate(found):
        if containers.pool is None:
            raise BadRequest(f"code_interpreter tool tools[{i}]: {containers.unavailable}",
                             param=f"tools[{i}].type", code="hosted_tool_unavailable")
        if n > 0:
            raise BadRequest("only one code_interpreter tool may be given", param=f"tools[{i}]")
        match tool.container:
            case CodeInterpreterAuto() as auto:
                _refuse_auto(auto, i)
            case str() as cid:
                try:
                    containers.pool.get(cid, owner)
                except ContainerError as exc:
                    raise BadRequest(f"code_interpreter tool tools[{i}]: {exc}", param=f"tools[{i}].container",
                                     code="container_not_found") from exc


def _refuse_auto(auto: CodeInterpreterAuto, i: int) -> None:
    """The 400s of an auto container: a network policy, too many file ids or a malformed one."""
    if auto.network_policy and auto.network_policy.get("type") != "disabled":
        raise BadRequest(f"code_interpreter tool tools[{i}]: the sandbox has no network here; "
                         "network_policy may only be {\"type\": \"disabled\"}",
                         param=f"tools[{i}].container.network_policy")
    ids = auto.file_ids or []
    if len(ids) > MAX_INPUT_FILES:
        raise BadRequest(f"code_interpreter tool tools[{i}]: at most {MAX_INPUT_FILES} file_ids",
                         param=f"tools[{i}].container.file_ids")
    for j, fid in enumerate(ids):
        checked_id(fid, FILE_PREFIX, f"tools[{i}].container.file_ids[{j}]")


def code_of(arguments: str) -> str | None:
    """The code of a call's arguments (``{"code": "..."}``), if they hold one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    code = value.get("code") if isinstance(value, dict) else None
    return code if isinstance(code, str) else None


def _earlier_container(items: list[Item]) -> str | None:
    ids = [it.container_id for it in items if isinstance(it, CodeInterpreterCallItem) and it.container_id]
    return ids[-1] if ids else None


@dataclass
class CodeSession:
    """One response's code_interpreter: the container its calls run in."""

    pool: ContainerPool
    owner: str | None
    # The container the tool names; else the one an earlier call used (auto).
    named: str | None = None
    earlier: str | None = None
    memory_mib: int | None = None
    container: Container | None = None
    # Calls that cannot run (no container, no code in the arguments): why.
    problems: dict[str, str] = field(default_factory=dict)
    # /v1/files to copy into the container before its first run here: (name, path).
    inputs: list[tuple[str, Path]] = field(default_factory=list)
    copied: set[str] = field(default_factory=set)
    # Files the runs of this response wrote: name -> its container's id.
    written: dict[str, str] = field(default_factory=dict)

    name = CODE_FUNCTION

    def function(self) -> FunctionTool:
        # The model opens the files by name: it must read them somewhere.
        given = f" The working folder holds these files: {', '.join(n for n, _ in self.inputs)}." \
            if self.inputs else ""
        return FunctionTool(name=CODE_FUNCTION, description=DESCRIPTION + given, parameters=PARAMETERS)

    def _container(self) -> Container:
        if self.container is not None:
            return self.container
        if self.named is not None:
            self.container = self.pool.get(self.named, self.owner)
        elif self.earlier is not None:
            try:
                self.container = self.pool.get(self.earlier, self.owner)
            except ContainerError:
                # Expired (or another key's): auto makes a new one.
                self.container = self.pool.create(self.owner)
        else:
            self.container = self.pool.create(self.owner)
        return self.container

    def item(self, call: ToolCall) -> CodeInterpreterCallItem:
        """The call's item; its container is found (or made) now, so the
        item names it from its first event."""
        code = code_of(call.arguments)
        item = CodeInterpreterCallItem(container_id="", code=call.arguments if code is None else code,
                                       id=new_id("ci"), status="in_progress" if call.complete else "incomplete")
        if not call.complete:
            return item
        try:
            item.container_id = self._container().id
        except ContainerError as exc:
            self.problems[item.id] = str(exc)
        if code is None:
            self.problems.setdefault(item.id, 'the call\'s arguments hold no code (expected {"code": "..."})')
        return item

    async def run(self, item: CodeInterpreterCallItem, limit_s: float) -> None:
        """Run the call's code into its item: outputs and status. Never
        raises for what the code does; a cancel kills the run."""
        problem = self.problems.get(item.id)
        container = None
        if problem is None:
            try:
                container = self.pool.get(item.container_id, self.owner)
            except ContainerError as exc:
                problem = str(exc)
        if problem is not None or container is None or item.code is None:
            item.outputs, item.status = [CodeLogs(f"[not run: {problem}]\n")], "failed"
            return
        try:
            await self._copy_inputs(container)
        except OSError as exc:
            log.warning("copying files into container %s failed: %s", container.id, exc)
            item.outputs, item.status = [CodeLogs(f"[not run: the files could not be copied in: {exc}]\n")], "failed"
            return
        limits = self.pool.spec.limits
        # The tool's auto memory_limit, else the one the container was made with (POST /v1/containers).
        memory = self.memory_mib if self.memory_mib is not None else container.memory_mib
        if memory is not None and memory < limits.memory_mib:
            limits = replace(limits, memory_mib=memory)
        try:
            run = await asyncio.wait_for(self.pool.run(container, item.code, limits), limit_s)
        except TimeoutError:
            # The sandbox's own wall clock is longer than what the loop had left.
            item.outputs = [CodeLogs(f"[stopped: the call took longer than {limit_s:g} s]\n")]
            item.status = "failed"
            return
        except (OSError, ValueError) as exc:
            # The sandbox could not start (or the code is over its size limit).
            log.warning("code_interpreter run failed: %s", exc)
            item.outputs, item.status = [CodeLogs(f"[not run: {exc}]\n")], "failed"
            return
        self.written.update((f.name, container.id) for f in run.files)
        while len(self.written) > MAX_CITED_FILES:  # the oldest go first (dicts keep their order)
            del self.written[next(iter(self.written))]
        outputs = call_outputs(run, container, wall_s=limits.wall_s, max_image_bytes=MAX_IMAGE_BYTES)
        item.outputs = [CodeLogs(o["logs"]) if o["type"] == "logs" else CodeImage(o["url"]) for o in outputs]
        item.status = call_status(run)

    async def recall_written(self) -> None:
        """Know the files code wrote in the container this response reuses
        (an earlier call's, or the one the tool names), so that an answer
        naming one cites it too: the most recent MAX_CITED_FILES of them."""
        cid = self.named or self.earlier
        if cid is None:
            return
        try:
            container = self.pool.get(cid, self.owner)
        except ContainerError:
            return  # expired, or another key's: a new one is made, with nothing to cite yet
        files, _ = await asyncio.to_thread(listing, container)
        ours = [f for f in files if f.source == "assistant"][-MAX_CITED_FILES:]
        self.written.update((f.name, container.id) for f in ours)

    async def _copy_inputs(self, container: Container) -> None:
        """Copy the request's files into the container once per container,
        under its lock (no run sees a half-copied file)."""
        if not self.inputs or container.id in self.copied:
            return
        async with container.lock:
            await asyncio.to_thread(copy_in, container, self.inputs, self.pool.owner_ids())
        self.copied.add(container.id)

    def annotations(self, text: str) -> list[dict[str, Any]]:
        """``container_file_citation`` annotations of an answer: each place
        it writes the name of a file a run of this response wrote (with the
        folder's path before it, if written so), longest names first, never
        two on one span."""
        found: list[tuple[int, int, str]] = []
        taken: list[tuple[int, int]] = []
        for name in sorted(self.written, key=lambda n: -len(n)):
            for match in re.finditer(re.escape(name), text):
                start, end = match.start(), match.end()
                prefix = next((p for p in _LINK_PREFIXES if text[max(0, start - len(p)):start] == p), "")
                start -= len(prefix)
                if not any(s < end and start < e for s, e in taken):
                    found.append((start, end, name))
                    taken.append((start, end))
        return [{"type": "container_file_citation", "container_id": self.written[name],
                 "file_id": file_id(self.written[name], name), "filename": name.rsplit("/", 1)[-1],
                 "start_index": start, "end_index": end} for start, end, name in sorted(found)]


async def code_inputs(tools: list[Any], files: FileStore | None, owner: str | None,
                      max_bytes: int) -> list[tuple[str, Path]]:
    """The (name, path) of each file the code_interpreter tool's ``file_ids``
    name, checked as :func:`input_files` checks them."""
    found = code_tools(tools)
    if not found or not isinstance(found[0][1].container, CodeInterpreterAuto):
        return []
    i, tool = found[0]
    assert isinstance(tool.container, CodeInterpreterAuto)
    ids = tool.container.file_ids or []
    if ids and files is None:
        raise BadRequest(f"code_interpreter tool tools[{i}]: files are not available on this server",
                         param=f"tools[{i}].container.file_ids")
    if files is None:
        return []
    return await input_files(ids, files, owner, max_bytes, f"tools[{i}].container.file_ids",
                             f"code_interpreter tool tools[{i}]: ")


async def input_files(ids: list[str], files: FileStore, owner: str | None, max_bytes: int, param: str,
                      label: str = "", *, one: bool = False) -> list[tuple[str, Path]]:
    """The (name, path) of each file ``ids`` name (a file named twice is
    one), each one ``owner`` may see; a 400 naming ``param[j]`` (``param``
    itself when ``one`` id is the field) for one it may not (or that does
    not exist), two of one name, or a 413 past ``max_bytes`` together.
    ``label`` starts each message."""
    out: list[tuple[str, Path]] = []
    total = 0
    for j, fid in enumerate(ids):
        if fid in ids[:j]:
            continue  # named twice: one file
        at = param if one else f"{param}[{j}]"
        try:
            rec = await files.get(checked_id(fid, FILE_PREFIX, at), owner)
        except NotFound as exc:
            raise BadRequest(f"{label}no file with id {fid!r}", param=at, code="file_not_found") from exc
        name = rec.filename
        if len(name.encode()) > MAX_FILE_NAME:
            raise BadRequest(f"{label}file {fid} has a name longer than {MAX_FILE_NAME} bytes, more than a "
                             "container's folder takes", param=at)
        if any(name == taken for taken, _ in out):
            raise BadRequest(f"{label}two files are named {name!r}; the code opens them by name", param=at)
        total += rec.bytes
        if total > max_bytes:
            raise PayloadTooLarge(f"{label}the files come to more than {max_bytes} bytes, the most a container "
                                  "takes in", param=param)
        out.append((name, files.path(rec.id)))
    return out


def open_code(tools: list[Any], items: list[Item], containers: Containers,
              owner: str | None) -> CodeSession | None:
    """The response's code_interpreter session (None: the request has no
    such tool). ``items``: the conversation so far, for auto's reuse.
    Raises BadRequest (:func:`refuse_code`)."""
    refuse_code(tools, containers, owner)
    found = code_tools(tools)
    if not found or containers.pool is None:
        return None
    tool = found[0][1]
    match tool.container:
        case str() as cid:
            return CodeSession(containers.pool, owner, named=cid)
        case CodeInterpreterAuto(memory_limit=memory):
            return CodeSession(containers.pool, owner, earlier=_earlier_container(items),
                               memory_mib=MEMORY_LIMITS_MIB[memory] if memory else None)
    return None


async def expire_idle(pool: ContainerPool, interval_s: float = 60.0) -> None:
    """Remove idle containers (and their folders) every ``interval_s``;
    runs until cancelled, by the owner of the service."""
    while True:
        await asyncio.sleep(interval_s)
        gone = pool.expire()
        if gone:
            log.debug("removed %d idle containers", len(gone))
