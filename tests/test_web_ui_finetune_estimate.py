"""The fine-tune form's live memory estimate, and a download's chat link
offered only for a model /v1/models lists, in headless Chromium against a
real gpuvisor (no GPU here: the estimate is set against RAM) and a local
stand-in for the Hub.

Screenshots go to the test's temp dir, and to GPUVISOR_SCREENS_DIR when set."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import DESKTOP, NARROW, new_page, shoot
from tests.browser import screens_fixture as screens  # noqa: F401 (a fixture)
from tests.fake_hub import FakeFile, FakeHub, FakeRepo
from tests.server import Server, poll_until, running, short_tempdir
from tests.test_job_estimate import write_model

pytestmark = pytest.mark.timeout(180)

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# An estimate's 400 while a setting cannot run here (a 4-bit base on the CPU).
REFUSED = ("status of 400",)


class HubThread:
    """The fake Hub on its own event loop, for a test that drives a browser."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> str:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.hub.start(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.hub.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    models, home = short_tempdir("gvm"), short_tempdir("gvhf")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    write_model(models / "tiny-ft")
    # A models dir file that holds the id the shadow repo's download gets.
    (models / "acme" / "shadow-GGUF").mkdir(parents=True)
    (models / "acme" / "shadow-GGUF" / "tiny-Q8_0.gguf").symlink_to(tiny_model_path)
    data = tiny_model_path.read_bytes()
    hub = HubThread(FakeHub(repos={
        "acme/tiny-GGUF": FakeRepo({"tiny-Q8_0.gguf": FakeFile(data)}),
        "acme/shadow-GGUF": FakeRepo({"tiny-Q8_0.gguf": FakeFile(data)}),
    }))
    url = hub.start()
    env = {"HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HOME": str(home), "OMP_NUM_THREADS": "1", "GPUVISOR_DATASETS_DIR": str(short_tempdir("gvd")),
           "GPUVISOR_OUTPUTS_DIR": str(short_tempdir("gvo"))}
    try:
        with running(Server(models, env=env, model="tiny")) as s:
            s.hf_home = home  # type: ignore[attr-defined]
            yield s
    finally:
        hub.stop()


@pytest.fixture(params=[pytest.param(DESKTOP, id="desktop"), pytest.param(NARROW, id="narrow")])
def page(request: pytest.FixtureRequest, browser: Any, srv: Server) -> Iterator[tuple[Any, Any, str]]:
    viewport: dict[str, int] = request.param
    context, pg, watch = new_page(browser, srv.base_url, viewport)
    yield pg, watch, "narrow" if viewport is NARROW else "desktop"
    context.close()


def size_bytes(text: str) -> float:
    """A size as the page writes it ("23.4 MiB") in bytes."""
    found = re.search(r"([\d.]+) (B|KiB|MiB|GiB|TiB)\b", text)
    assert found is not None, text
    return float(found.group(1)) * _UNITS[found.group(2)]


def parts(pg: Any) -> dict[str, str]:
    dl = pg.locator(".estimate dl.estimate-parts")
    terms = [t.strip() for t in dl.locator("dt").all_inner_texts()]
    return dict(zip(terms, [v.strip() for v in dl.locator("dd").all_inner_texts()], strict=True))


def changed(pg: Any, selector: str, before: str) -> str:
    pg.wait_for_function("([s, b]) => { const el = document.querySelector(s);"
                         " return el && !el.closest('.stale') && el.textContent !== b; }", arg=[selector, before])
    text: str = pg.locator(selector).inner_text()
    return text


def test_estimate_follows_the_settings(page: tuple[Any, Any, str], srv: Server, screens: Path) -> None:
    pg, watch, size = page
    pg.goto(f"{srv.base_url}/#/jobs?new=finetune")
    form = pg.locator("#submit-finetune")
    form.wait_for()
    panel = pg.locator(".estimate")
    assert "Pick a model" in panel.inner_text()

    form.locator("details.more > summary").click()
    form.locator("#submit-finetune-model").fill("tiny-ft")
    total = changed(pg, ".estimate .estimate-total", "")
    assert "in RAM" in total and "float32" in total, total
    first = parts(pg)
    assert set(first) == {"Weights", "Adapter, gradients, optimizer", "Activations", "Logits", "Total"}
    assert "Fits in the free memory of cpu" in panel.inner_text()
    batch_cost = form.locator("[data-cost-of=batch_size]")
    assert "activations and logits" in batch_cost.inner_text()
    panel.scroll_into_view_if_needed()
    shoot(pg, screens, f"finetune-estimate-{size}")

    # Four times the batch: four times the activations and logits, the same weights.
    form.locator("#submit-finetune-batch_size").fill("8")
    total8 = changed(pg, ".estimate .estimate-total", total)
    now = parts(pg)
    assert size_bytes(total8) > size_bytes(total)
    assert size_bytes(now["Activations"]) == pytest.approx(4 * size_bytes(first["Activations"]), rel=0.02)
    assert now["Weights"] == first["Weights"]
    assert batch_cost.inner_text() != "" and "16384 tokens" in batch_cost.inner_text()

    # Checkpointing off: far more activations, and the line under it says so.
    ckpt_cost = form.locator("[data-cost-of=gradient_checkpointing]")
    assert "with it off" in ckpt_cost.inner_text()
    form.locator("#submit-finetune-gradient_checkpointing").uncheck()
    changed(pg, ".estimate .estimate-total", total8)
    assert size_bytes(parts(pg)["Activations"]) > size_bytes(now["Activations"])
    assert "with it on" in ckpt_cost.inner_text()

    # The 4-bit base: the line under it says it needs a GPU; turned on here, why there is no estimate.
    four_bit = form.locator("[data-cost-of=load_in_4bit]")
    four_bit.wait_for()
    assert "needs a CUDA GPU" in four_bit.inner_text()
    form.locator("#submit-finetune-load_in_4bit").check()
    pg.locator(".estimate .estimate-none").wait_for()
    assert "needs a CUDA GPU" in panel.inner_text()
    # ... and under the setting itself, where the user just changed it.
    assert "needs a CUDA GPU" in form.locator("[data-cost-of=load_in_4bit].refused").inner_text()
    assert form.locator("[data-cost-of=batch_size]").count() == 0
    form.locator("#submit-finetune-load_in_4bit").scroll_into_view_if_needed()
    shoot(pg, screens, f"finetune-estimate-4bit-{size}", both=False)
    width = pg.evaluate("() => document.documentElement.scrollWidth")
    assert width <= pg.viewport_size["width"], f"the page scrolls sideways: {width}"
    watch.check(allow=REFUSED)


def download(srv: Server, repo: str) -> dict[str, Any]:
    r = httpx.post(f"{srv.base_url}/api/jobs", json={"kind": "download", "params": {"repo_id": repo, "quant": "Q8_0"}},
                   timeout=30)
    assert r.status_code in (200, 201), r.text
    job: dict[str, Any] = poll_until(lambda: httpx.get(f"{srv.base_url}/api/jobs/{r.json()['id']}", timeout=10).json(),
                                     lambda j: j["status"] not in ("queued", "running"), timeout=120)
    assert job["status"] == "succeeded", job
    return job


def listed(srv: Server) -> set[str]:
    return {m["id"] for m in httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"]}


def result_text(pg: Any, srv: Server, job_id: str) -> Any:
    pg.goto(f"{srv.base_url}/#/jobs/{job_id}")
    summary = pg.locator("section[aria-label=Result] .result-summary")
    summary.wait_for()
    return summary


def test_download_links_to_chat_only_when_listed(browser: Any, srv: Server, screens: Path) -> None:
    context, pg, watch = new_page(browser, srv.base_url, DESKTOP)
    try:
        job = download(srv, "acme/tiny-GGUF")
        model_id = job["result"]["model_id"]
        summary = result_text(pg, srv, job["id"])
        # Listed (after the library's rescan): the link, and it opens the chat with the model.
        summary.get_by_role("link", name="Chat with this model").wait_for()
        assert model_id in listed(srv)
        shoot(pg, screens, "download-listed", both=False)

        # Its id taken by a models dir file: no link, and the file that holds the id.
        shadow = download(srv, "acme/shadow-GGUF")
        summary = result_text(pg, srv, shadow["id"])
        text = summary.locator(".listed-model.not-listed").inner_text()
        assert "taken by" in text and "shadow-GGUF" in text, text
        assert summary.get_by_role("link", name="Chat with this model").count() == 0

        # The file gone from the cache: no longer listed, so no link, and why.
        for path in srv.hf_home.glob("hub/models--acme--tiny-GGUF/**/*.gguf"):  # type: ignore[attr-defined]
            path.unlink()
        poll_until(lambda: listed(srv), lambda ids: model_id not in ids, timeout=20)
        summary = result_text(pg, srv, job["id"])
        note = summary.locator(".listed-model.not-listed")
        note.wait_for(timeout=30_000)
        text = note.inner_text()
        assert "Not listed in /v1/models" in text and "hf_cache_dir" in text, text
        assert summary.get_by_role("link", name="Chat with this model").count() == 0
        shoot(pg, screens, "download-not-listed", both=False)
        watch.check()
    finally:
        context.close()
