"""Red-team cases for the code_interpreter sandbox, each a real run of
hostile code (supervisor/sandbox/): what it tries must fail, and the
machine must stay fine."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from supervisor.sandbox import init
from supervisor.sandbox.runner import INIT_SCRIPT, SandboxLimits, SandboxSpec, init_spec, run_code
from tests.sandbox_support import FAST, sandbox_python_or_skip

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def sandbox_python() -> str:
    return sandbox_python_or_skip()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A container folder the sandbox's user may write."""
    path = tmp_path / "work"
    path.mkdir()
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    return path


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    (path / "gpuvisor.db").write_text("SECRET-STATE")
    return path


@pytest.fixture
def mark() -> Iterator[dict[str, str]]:
    """An environment whose marker (LC_ passes the allowlist) finds every
    process of the run afterwards, wherever it went."""
    value = uuid.uuid4().hex
    yield {"PATH": "/usr/bin:/bin", "LC_SANDBOX_MARK": value}
    assert _marked(value) == [], "a process of the sandbox outlived its run"


def _marked(value: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("LC_SANDBOX_MARK") == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _spec(python: str, **limits: float) -> SandboxSpec:
    return SandboxSpec(python=python, limits=replace(FAST, **limits))  # type: ignore[arg-type]


async def test_a_fork_bomb_is_contained(sandbox_python: str, work: Path, tmp_path: Path,
                                        mark: dict[str, str]) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    spec = _spec(sandbox_python, processes=16, wall_s=4.0)
    task = asyncio.create_task(run_code(spec, work, code, environ=mark))
    await asyncio.sleep(1.5)
    # While it runs: at most its process limit, we still start processes,
    # and another sandbox (the same uid) has its own budget of processes.
    assert 0 < len(_marked(mark["LC_SANDBOX_MARK"])) <= 16
    proc = await asyncio.create_subprocess_exec("true")
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    other = tmp_path / "other"
    other.mkdir()
    shutil.copystat(work, other)
    if os.geteuid() == 0:
        os.chown(other, 65534, 65534)
    forks = ("import os\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
             "        os._exit(0)\n    pids.append(pid)\nfor p in pids:\n    os.waitpid(p, 0)\n"
             "print('forked', len(pids))\n")
    beside = await run_code(spec, other, forks, environ=mark)
    assert beside.stdout == "forked 4\n", beside.stderr
    result = await task
    assert result.timed_out and result.exit_code is None
    assert result.wall_s < 15


async def test_a_memory_bomb_dies_at_its_limit(sandbox_python: str, work: Path, mark: dict[str, str]) -> None:
    code = ("blocks = []\ntry:\n    while True:\n        blocks.append(bytearray(16 << 20))\n"
            "except MemoryError:\n    print('stopped at', len(blocks) * 16, 'MiB')\n    raise\n")
    result = await run_code(_spec(sandbox_python, memory_mib=256), work, code, environ=mark)
    assert not result.timed_out and result.exit_code == 1
    assert "MemoryError" in result.stderr
    assert int(result.stdout.split()[2]) < 256


async def test_an_infinite_loop_is_killed_at_the_wall_clock(sandbox_python: str, work: Path,
                                                            mark: dict[str, str]) -> None:
    # A child that leaves the process group and sleeps is killed too.
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
            "while True:\n    pass\n")
    result = await run_code(_spec(sandbox_python, wall_s=1.5), work, code, environ=mark)
    assert result.timed_out and result.exit_code is None
    assert 1.5 <= result.wall_s < 10


async def test_cpu_time_is_limited(sandbox_python: str, work: Path, mark: dict[str, str]) -> None:
    result = await run_code(_spec(sandbox_python, cpu_s=1, wall_s=30.0), work, "while True:\n    pass\n",
                            environ=mark)
    assert not result.timed_out
    assert result.exit_code in (128 + 24, 128 + 9)  # SIGXCPU at the limit (or SIGKILL past it)


async def test_writing_outside_its_folder_fails(sandbox_python: str, work: Path, state: Path,
                                               mark: dict[str, str]) -> None:
    name = "sbx-" + mark["LC_SANDBOX_MARK"]
    blocked = [state / name, state / "gpuvisor.db", REPO / name, Path(sys.prefix) / name, Path("/etc") / name,
               Path.home() / name]
    scratch = [Path("/tmp") / name, Path("/var/tmp") / name, Path("/dev/shm") / name]
    code = (f"import json\nout = {{}}\nfor path in {[str(p) for p in blocked + scratch]!r}:\n"
            "    try:\n        open(path, 'a').write('x')\n        out[path] = 'written'\n"
            "    except OSError as exc:\n        out[path] = exc.strerror\n"
            "open('inside.txt', 'w').write('fine')\nprint(json.dumps(out))\n")
    spec = replace(_spec(sandbox_python), hide=(str(state),))
    result = await run_code(spec, work, code, environ=mark)
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    for path in blocked:
        assert out[str(path)] != "written", path
        assert not path.exists() or path == state / "gpuvisor.db"
    # /tmp and the like are the sandbox's own: written there, gone with it.
    for path in scratch:
        assert not path.exists()
    assert (state / "gpuvisor.db").read_text() == "SECRET-STATE"
    assert (work / "inside.txt").read_text() == "fine"


async def test_reading_the_state_dir_fails(sandbox_python: str, work: Path, state: Path,
                                          mark: dict[str, str]) -> None:
    # A stdlib folder of the sandbox's Python stands for a hidden path
    # outside /tmp (the state dir of a test is under it, replaced anyway):
    # hidden, it is empty and unreadable, and its modules cannot be imported.
    found = subprocess.run([sandbox_python, "-I", "-c", "import xmlrpc; print(xmlrpc.__path__[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    code = ("import os\n"
            f"for path in ({str(state)!r}, {found!r}):\n"
            "    try:\n        print(path, 'listed', os.listdir(path))\n"
            "    except OSError as exc:\n        print(path, 'refused', exc.strerror)\n"
            f"try:\n    print(open({str(state / 'gpuvisor.db')!r}).read())\n"
            "except OSError as exc:\n    print('db refused', exc.strerror)\n"
            "try:\n    import xmlrpc.client\n    print('imported')\n"
            "except ImportError as exc:\n    print('import refused')\n"
            "import json\nprint('json still imports')\n")
    spec = replace(_spec(sandbox_python), hide=(str(state), found))
    result = await run_code(spec, work, code, environ=mark)
    assert result.exit_code == 0, result.stderr
    assert "SECRET-STATE" not in result.stdout and "db refused" in result.stdout
    assert f"{found} listed" not in result.stdout or f"{found} listed []" in result.stdout
    assert "import refused" in result.stdout and "json still imports" in result.stdout


async def test_opening_a_socket_fails(sandbox_python: str, work: Path, mark: dict[str, str]) -> None:
    connections = 0

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    abstract_name = "\0sbx-" + mark["LC_SANDBOX_MARK"]
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(abstract_name)
    abstract.listen()
    code = ("import socket\n"
            "def attempt(what, make):\n"
            "    try:\n        make()\n        print(what, 'connected')\n"
            "    except OSError as exc:\n        print(what, 'refused', exc.errno)\n"
            f"attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=2))\n"
            "attempt('dns', lambda: socket.getaddrinfo('example.com', 443))\n"
            "attempt('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('1.1.1.1', 53)))\n"
            "u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            f"attempt('unix', lambda: u.connect({abstract_name!r}))\n")
    try:
        result = await run_code(_spec(sandbox_python), work, code, environ=mark)
    finally:
        server.close()
        await server.wait_closed()
        abstract.close()
    assert result.exit_code == 0, result.stderr
    assert "connected" not in result.stdout
    assert result.stdout.count("refused") == 4
    assert connections == 0


async def test_the_environment_has_no_secrets(sandbox_python: str, work: Path, mark: dict[str, str]) -> None:
    secrets = {"HF_TOKEN": "hf_sekrit1", "OPENAI_API_KEY": "sk-sekrit2", "GPUVISOR_ADMIN_TOKEN": "sekrit3",
               "AWS_SECRET_ACCESS_KEY": "sekrit4", "HTTPS_PROXY": "http://user:sekrit5@proxy:3128",
               "LC_API_KEY": "sekrit6"}
    env = {**mark, **secrets, "LANG": "C.UTF-8"}
    code = "import json, os\nprint(json.dumps(dict(os.environ)))\n"
    result = await run_code(_spec(sandbox_python), work, code, environ=env)
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    assert "sekrit" not in result.stdout
    assert not set(secrets) & set(seen)
    assert seen["LANG"] == "C.UTF-8" and seen["HOME"] == init.WORK


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become another user")
def test_an_unprivileged_service_gets_the_same_sandbox(sandbox_python: str) -> None:
    """The path a service that is not root takes: a user namespace where it
    is root, mapped to its own uid. Run as nobody, the sandbox's own setup."""
    # Not under pytest's own folder, which nobody may not enter.
    work = Path(tempfile.mkdtemp(prefix="sbx-"))
    os.chown(work, 65534, 65534)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = ("import os, socket\nprint('uid', os.getuid())\nforks = 0\n"
            "for _ in range(64):\n    try:\n        if os.fork() == 0:\n            import time\n"
            "            time.sleep(2)\n            os._exit(0)\n        forks += 1\n"
            "    except OSError:\n        break\nprint('forks', forks)\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
            "except OSError:\n    print('no network')\n"
            "try:\n    open('/etc/sbx-test', 'w')\nexcept OSError as exc:\n    print('etc', exc.strerror)\n")
    spec = SandboxSpec(python=sandbox_python, limits=replace(FAST, processes=8))
    try:
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              sandbox_python, "-I", "-S", str(INIT_SCRIPT),
                              init_spec(spec, work, {"PATH": "/usr/bin:/bin"})],
                             input=code, capture_output=True, text=True, timeout=30, check=False)
    finally:
        listener.close()
        shutil.rmtree(work)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "uid 0"  # root of its own namespace, nobody outside
    assert 0 < int(lines[1].split()[1]) < 8
    assert lines[2:] == ["no network", "etc Read-only file system"]


def test_without_namespaces_the_tool_is_refused(tmp_path: Path) -> None:
    """Where no namespace can be made (here: a user namespace allowed none
    nested), the probe names the reason and the code never runs."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) to make the namespace that allows none")
    tmp_path.chmod(0o777)
    script = ("import asyncio, sys\nfrom pathlib import Path\n"
              "from supervisor.sandbox.runner import SandboxSpec, probe\n"
              f"print(asyncio.run(probe(SandboxSpec(python=sys.executable), Path({str(tmp_path)!r}))))\n")
    out = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                          'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"',
                          sys.executable, script],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    if "max_user_namespaces" in out.stderr:
        pytest.skip(f"cannot forbid namespaces here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("the sandbox cannot be set up: unshare (namespaces): "
                                  "No space left on device"), out.stdout


async def test_nothing_outlives_the_service(sandbox_python: str, work: Path, mark: dict[str, str]) -> None:
    """The service killed mid-run (no wall clock of its own runs then): the
    sandbox and all it started end with it, a child that left the group too."""
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
            "time.sleep(1000)\n")
    script = ("import asyncio, os\nfrom pathlib import Path\n"
              "from supervisor.sandbox.runner import SandboxLimits, SandboxSpec, run_code\n"
              f"spec = SandboxSpec(python={sandbox_python!r}, limits=SandboxLimits(wall_s=300.0))\n"
              f"asyncio.run(run_code(spec, Path({str(work)!r}), {code!r}, environ=os.environ))\n")
    service = await asyncio.create_subprocess_exec(sys.executable, "-c", script, cwd=REPO,
                                                   env={**mark, "PYTHONPATH": str(REPO)})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    # The code and its child (the service has the mark too).
    while len(set(_marked(mark["LC_SANDBOX_MARK"])) - {service.pid}) < 2:
        assert loop.time() < deadline and service.returncode is None
        await asyncio.sleep(0.1)
    service.kill()
    await service.wait()
    deadline = loop.time() + 15
    while _marked(mark["LC_SANDBOX_MARK"]):
        assert loop.time() < deadline, "the sandbox outlived the service"
        await asyncio.sleep(0.1)
