"""A local stand-in for the Hugging Face Hub's HTTP API, on 127.0.0.1.

It speaks what ``huggingface_hub`` asks for when it lists a model repo and
downloads files into its cache (checked against the installed version):

- ``GET /api/models/{repo}[/revision/{rev}]`` (``?blobs=True`` adds sizes,
  blob ids and LFS info to ``siblings``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]`` (one page);
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``,
  ``ETag`` (the LFS sha256 or the git blob id), ``X-Linked-Size`` and
  ``Content-Length``; ``Range: bytes=N-`` answered with 206.

A file may *claim* a size larger than its content (for disk-full tests: it
must then never be fetched). Downloads can be throttled to make cancel tests
deterministic. Every request is recorded with its Authorization header.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler

_RANGE = re.compile(r"^bytes=(\d+)-$")


@dataclass
class FakeFile:
    content: bytes
    claimed_size: int | None = None  # advertised size, when not len(content)
    lfs: bool = True

    @property
    def size(self) -> int:
        return self.claimed_size if self.claimed_size is not None else len(self.content)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class FakeRepo:
    files: dict[str, FakeFile]
    commit: str = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None
    range: str | None


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    # Bytes per second for file bodies; 0 = as fast as possible.
    rate: int = 0
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> str:
        """Serve on loopback (``port`` 0: any free one); the base URL."""
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{name}", self._info)
        app.router.add_get("/api/models/{owner}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{owner}/{name}/tree/{rev}", self._tree)
        app.router.add_get("/api/models/{owner}/{name}/tree/{rev}/{path:.+}", self._tree)
        app.router.add_route("HEAD", "/{owner}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        app.router.add_get(
            "/{owner}/{name}/resolve/{rev}/{path:.+}", self._resolve, allow_head=False
        )
        app.middlewares.append(self._record)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def gets(self, path_suffix: str) -> int:
        """How many file bodies were requested for a path ending in ``path_suffix``."""
        return sum(
            1
            for r in self.requests
            if r.method == "GET" and "/resolve/" in r.path and r.path.endswith(path_suffix)
        )

    @web.middleware
    async def _record(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.requests.append(
            Request(
                request.method,
                request.path,
                request.headers.get("Authorization"),
                request.headers.get("Range"),
            )
        )
        return await handler(request)

    def _repo(self, request: web.Request) -> tuple[str, FakeRepo]:
        repo_id = f"{request.match_info['owner']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise web.HTTPNotFound(
                text='{"error":"Repository not found"}',
                content_type="application/json",
                headers={"X-Error-Code": "RepoNotFound"},
            )
        rev = request.match_info.get("rev", "main")
        if rev not in ("main", repo.commit):
            raise web.HTTPNotFound(
                text='{"error":"Invalid rev id"}',
                content_type="application/json",
                headers={"X-Error-Code": "RevisionNotFound"},
            )
        return repo_id, repo

    async def _info(self, request: web.Request) -> web.Response:
        repo_id, repo = self._repo(request)
        blobs = request.query.get("blobs", "").lower() == "true"
        siblings = []
        for path, f in sorted(repo.files.items()):
            entry: dict[str, object] = {"rfilename": path}
            if blobs:
                entry.update(size=f.size, blobId=f.git_oid)
                if f.lfs:
                    entry["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
            siblings.append(entry)
        return web.json_response(
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.commit,
                "private": False,
                "tags": ["gguf"],
                "siblings": siblings,
            }
        )

    async def _tree(self, request: web.Request) -> web.Response:
        _, repo = self._repo(request)
        prefix = request.match_info.get("path", "")
        out = []
        for path, f in sorted(repo.files.items()):
            if prefix and not path.startswith(prefix.rstrip("/") + "/"):
                continue
            item: dict[str, object] = {
                "type": "file",
                "path": path,
                "size": f.size,
                "oid": f.git_oid,
            }
            if f.lfs:
                item["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
            out.append(item)
        return web.json_response(out)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        _, repo = self._repo(request)
        f = repo.files.get(request.match_info["path"])
        if f is None:
            raise web.HTTPNotFound(
                text='{"error":"Entry not found"}',
                content_type="application/json",
                headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit},
            )
        headers = {
            "X-Repo-Commit": repo.commit,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
            "X-Linked-Size": str(f.size),
        }
        if request.method == "HEAD":
            return web.Response(status=200, headers={**headers, "Content-Length": str(f.size)})
        start = 0
        match = _RANGE.match(request.headers.get("Range", ""))
        if match:
            start = int(match.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(f.content) - 1}/{len(f.content)}"
        body = f.content[start:]
        resp = web.StreamResponse(status=206 if match else 200, headers=headers)
        resp.content_length = len(body)
        await resp.prepare(request)
        await self._send(resp, body)
        await resp.write_eof()
        return resp

    async def _send(self, resp: web.StreamResponse, body: bytes) -> None:
        step = 64 * 1024
        for i in range(0, len(body), step):
            await resp.write(body[i : i + step])
            if self.rate:
                await asyncio.sleep(step / self.rate)
