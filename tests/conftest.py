from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.models.demo import write_tiny_gguf
from tests import scheduling
from tests.browser import launch, require_browser
from tests.server import Server, running, short_tempdir
from tests.tiny_bpe import write_tiny_bpe


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a GPT-2 style byte-level BPE vocab (tests/tiny_bpe.py)."""
    return write_tiny_bpe(tmp_path_factory.mktemp("models") / "tiny-bpe.gguf")


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    with running(Server(models)) as srv:
        yield srv


@pytest.fixture
def start_server() -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(models_dir: Path, env: dict[str, str] | None = None,
              args: list[str] | None = None, wait_ready: bool = True) -> Server:
        srv = Server(models_dir, env=env, args=args)
        started.append(srv)
        return srv.start(wait_ready=wait_ready)

    yield start
    for srv in started:
        srv.cleanup()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium per test module (skipped where none is installed)."""
    require_browser()
    with launch() as b:
        yield b


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    scheduling.order(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> scheduling.ModuleScheduling | None:
    """Whole modules per worker (``--dist loadfile``), the vLLM ones on one (tests/scheduling.py)."""
    if config.getoption("dist") != "loadfile":
        return None  # xdist's own for any other mode
    return scheduling.ModuleScheduling(config, log)
