"""Headless Chromium for the UI tests: Playwright driving the system's
``/usr/bin/chromium`` (never a downloaded browser build)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 800}
NARROW = {"width": 390, "height": 844}


def require_browser() -> None:
    """Skip with the reason when the system browser or Playwright is absent."""
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")


@contextmanager
def launch() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class PageWatch:
    """What a page did that a test should fail on: script errors, failed
    requests, console errors and any request leaving the server's origin."""

    origin: str
    errors: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", self._console)
        page.on("request", self._request)

    def _console(self, msg: Any) -> None:
        if msg.type == "error":
            self.errors.append(f"console: {msg.text}")

    def _request(self, request: Any) -> None:
        url = request.url
        if not (url.startswith(self.origin) or url.startswith("data:")):
            self.foreign.append(url)

    def check(self, allow: tuple[str, ...] = ()) -> None:
        errors = [e for e in self.errors if not any(a in e for a in allow)]
        assert not errors, errors
        assert not self.foreign, f"requests outside the server: {self.foreign}"


@pytest.fixture(scope="module")
def screens_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module's screenshot dir; with GPUVISOR_SCREENS_DIR set, its PNGs are
    copied there at the end, for a person to look at. A test module takes it
    as ``from tests.browser import screens_fixture as screens``."""
    path = tmp_path_factory.mktemp("screens")
    yield path
    copy = os.environ.get("GPUVISOR_SCREENS_DIR")
    if copy:
        dest = Path(copy)
        dest.mkdir(parents=True, exist_ok=True)
        for png in path.glob("*.png"):
            (dest / png.name).write_bytes(png.read_bytes())


def save_screens(src: Path, names: list[str], dest: Path) -> None:
    """Copy screenshots somewhere a person can look at them."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).exists():
            shutil.copy(src / name, dest / name)


def new_page(browser: Any, origin: str, viewport: dict[str, int] | None = None,
             dark: bool = False, timeout_ms: int = 20_000) -> tuple[Any, Any, PageWatch]:
    """A fresh context and page (light or dark colour scheme) with a PageWatch."""
    context = browser.new_context(viewport=viewport or DESKTOP, color_scheme="dark" if dark else "light")
    context.set_default_timeout(timeout_ms)
    pg = context.new_page()
    watch = PageWatch(origin)
    watch.attach(pg)
    return context, pg, watch


def shoot(pg: Any, dest: Path, name: str, full_page: bool = False, both: bool = True) -> Path:
    """Save ``name``.png as the page looks now and, with ``both``, also
    ``name``-dark.png under prefers-color-scheme: dark (then back to light)."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{name}.png"
    pg.screenshot(path=str(path), full_page=full_page)
    if both:
        pg.emulate_media(color_scheme="dark")
        pg.screenshot(path=str(dest / f"{name}-dark.png"), full_page=full_page)
        pg.emulate_media(color_scheme="light")
    return path
