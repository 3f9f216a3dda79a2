"""Job pages and forms that read as a person expects, in headless Chromium at
1280x800 and 390x844 against a real gpuvisor on a machine without a GPU:
durations only where a field is one (Tokens/s is a rate), small sizes in KiB,
no "null" in a form, one "Dataset file", the device a job ran on (cpu), a
download that cannot reach the Hub explains what to do instead, and a repo id
without an owner is refused (API, CLI and form) before anything is queued.

Screenshots (light and dark) go to the test's temp dir, and to
GPUVISOR_SCREENS_DIR when set."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import screens_fixture as screens  # noqa: F401 (a fixture)
from tests.browser import DESKTOP, NARROW, new_page, shoot
from tests.server import REPO, Server, poll_until, running, short_tempdir

pytestmark = pytest.mark.timeout(180)

VIEWPORTS = [pytest.param(DESKTOP, id="desktop"), pytest.param(NARROW, id="narrow")]
# A duration as formatDuration writes one: "7s", "3m 05s", "2h 10m".
DURATION = re.compile(r"^(\d+s|\d+m \d\ds|\d+h \d\dm|\d+d \d+h)$")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Nothing listens here: the Hub is unreachable, as on a machine offline.
HUB = f"http://127.0.0.1:{_closed_port()}"


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    from tests.tiny_hf import build_tiny_model, write_chat_dataset

    models, data, outputs, cache = (short_tempdir(p) for p in ("gvm", "gvd", "gvo", "gvhf"))
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    build_tiny_model(models / "tiny-hf")
    write_chat_dataset(data / "qa.train.jsonl")
    env = {"GPUVISOR_DATASETS_DIR": str(data), "GPUVISOR_OUTPUTS_DIR": str(outputs), "OMP_NUM_THREADS": "1",
           "HF_ENDPOINT": HUB, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1"}
    with running(Server(models, env=env, model="tiny")) as s:
        yield s


@pytest.fixture(params=VIEWPORTS)
def page(request: pytest.FixtureRequest, browser: Any, srv: Server) -> Iterator[tuple[Any, Any, str]]:
    viewport: dict[str, int] = request.param
    context, pg, watch = new_page(browser, srv.base_url, viewport)
    yield pg, watch, "narrow" if viewport is NARROW else "desktop"
    context.close()


def open_page(pg: Any, srv: Server, route: str) -> None:
    pg.goto(f"{srv.base_url}/#{route}")
    pg.wait_for_selector("main h1")


def submit(srv: Server, kind: str, params: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{srv.base_url}/api/jobs", json={"kind": kind, "params": params}, timeout=30)
    assert r.status_code in (200, 201), r.text
    job: dict[str, Any] = r.json()
    return job


def finished(srv: Server, job_id: str, timeout: float = 150) -> dict[str, Any]:
    return poll_until(lambda: httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json(),
                      lambda j: j["status"] not in ("queued", "running"), timeout=timeout)


def fits_the_width(pg: Any) -> None:
    width = pg.evaluate("() => document.documentElement.scrollWidth")
    viewport = pg.viewport_size["width"]
    assert width <= viewport, f"the page scrolls sideways at {viewport}px: {width}"


def facts(pg: Any, section: str) -> dict[str, str]:
    """A <dl>'s terms and values in a card, as shown."""
    dl = pg.locator(f"section[aria-label={section}] dl").first
    dl.locator("dt").first.wait_for()
    terms = [t.strip() for t in dl.locator("dt").all_inner_texts()]
    values = [v.strip() for v in dl.locator("dd").all_inner_texts()]
    return dict(zip(terms, values, strict=True))


# ---------------------------------------------------------------- forms


def test_forms_have_one_label_per_field_and_no_null(page: tuple[Any, Any, str], srv: Server, screens: Path) -> None:
    pg, watch, size = page
    open_page(pg, srv, "/jobs")
    form = pg.locator("#submit-dataset")
    form.wait_for()
    labels = [t.strip() for t in form.locator("label").all_text_contents()]
    assert labels.count("Dataset file") + labels.count("Dataset file *") == 1, labels
    assert "Upload a file" in labels, labels
    assert len(labels) == len(set(labels)), f"two fields share a label: {labels}"
    shoot(pg, screens, f"jobs-dataset-form-{size}", both=False)

    pg.locator(".segmented button[data-kind=finetune]").click()
    form = pg.locator("#submit-finetune")
    form.wait_for()
    form.locator("details.more > summary").click()
    export = form.locator("#submit-finetune-export")
    export.wait_for()
    assert export.input_value() == "", f"Export options prefilled with {export.input_value()!r}"
    # No JSON field of any kind starts with the text "null".
    for kind in ("dataset", "finetune", "export", "quantize", "download"):
        pg.locator(f".segmented button[data-kind={kind}]").click()
        pg.locator(f"#submit-{kind}").wait_for()
        values = pg.locator(f"#submit-{kind} textarea, #submit-{kind} input").evaluate_all(
            "els => els.map(e => e.value)")
        assert "null" not in values, (kind, values)
    # Quantize runs on the CPU and books no GPU: its form offers no GPU choice.
    pg.locator(".segmented button[data-kind=quantize]").click()
    pg.locator("#submit-quantize details.more > summary").click()
    assert pg.locator("#submit-quantize [data-field=nthread]").is_visible()
    assert pg.locator("#submit-quantize [data-field=gpus]").count() == 0
    assert pg.locator("#submit-quantize [data-field=gpu_ids]").count() == 0

    pg.locator(".segmented button[data-kind=finetune]").click()
    pg.locator("#submit-finetune details.more > summary").click()
    pg.locator("#submit-finetune-export").scroll_into_view_if_needed()
    shoot(pg, screens, f"jobs-finetune-form-{size}")
    fits_the_width(pg)
    watch.check()


# ---------------------------------------------------------------- job pages


@pytest.fixture(scope="module")
def finetune_job(srv: Server) -> dict[str, Any]:
    job = submit(srv, "finetune", {"model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 4,
                                   "batch_size": 2, "save_steps": 1000, "output_name": "ui-metrics"})
    done = finished(srv, job["id"])
    assert done["status"] == "succeeded", done
    return done


def test_finetune_metrics_are_rates_and_durations(page: tuple[Any, Any, str], srv: Server,
                                                  finetune_job: dict[str, Any], screens: Path) -> None:
    pg, watch, size = page
    open_page(pg, srv, f"/jobs/{finetune_job['id']}")
    pg.locator(".job-head .badge", has_text="succeeded").wait_for()
    card = pg.locator("section[aria-label=Metrics]")
    card.get_by_text("Tokens/s").wait_for()
    metrics = dict(zip([t.strip() for t in card.locator("dt").all_inner_texts()],
                       [v.strip() for v in card.locator("dd").all_inner_texts()], strict=True))
    # A rate reads as a number, not as a time ("22m 25s" was 1,345 tokens/s).
    assert re.fullmatch(r"[\d,.]+", metrics["Tokens/s"]), metrics
    assert float(metrics["Tokens/s"].replace(",", "")) > 0, metrics
    assert DURATION.match(metrics["Elapsed"]) and DURATION.match(metrics["ETA"]), metrics
    assert metrics["Step"] == "4", metrics
    # The lease's only device is the CPU: the page says so, not "GPUs 1".
    params = facts(pg, "Parameters")
    assert params.get("Device", "").startswith("cpu"), params
    assert "GPUs" not in params and "Which GPUs" not in params, params
    card.scroll_into_view_if_needed()
    shoot(pg, screens, f"job-finetune-metrics-{size}")
    fits_the_width(pg)
    watch.check()


@pytest.fixture(scope="module")
def quantize_job(srv: Server) -> dict[str, Any]:
    done = finished(srv, submit(srv, "quantize", {"model": "tiny", "type": "Q8_0", "output_name": "tiny-ui-q8"})["id"])
    assert done["status"] == "succeeded", done
    return done


def test_quantize_page_small_sizes_and_the_cpu(page: tuple[Any, Any, str], srv: Server,
                                                quantize_job: dict[str, Any], screens: Path) -> None:
    pg, watch, size = page
    # The job's own last message, as stored: a model of a few hundred KiB.
    assert re.search(r"\d[\d.,]* KiB of about [\d.,]+ KiB written", quantize_job["message"] or ""), quantize_job
    open_page(pg, srv, f"/jobs/{quantize_job['id']}")
    stage = pg.locator("section[aria-label=Status] .stage")
    stage.get_by_text("Finished").wait_for()
    assert "0 of about 0 MiB" not in stage.inner_text() and " KiB" in stage.inner_text(), stage.inner_text()
    summary = pg.locator("section[aria-label=Result] .result-summary")
    summary.wait_for()
    assert re.search(r"Size\s+\d+(\.\d)? KiB", summary.inner_text()), summary.inner_text()
    params = facts(pg, "Parameters")
    # Quantize runs on the CPU's kernels and books no device: none is shown.
    assert "GPUs" not in params and "Device" not in params, params
    shoot(pg, screens, f"job-quantize-{size}")
    fits_the_width(pg)
    watch.check()


# ---------------------------------------------------------------- downloads


def test_failed_download_shows_what_to_do_offline(page: tuple[Any, Any, str], srv: Server, screens: Path) -> None:
    pg, watch, size = page
    open_page(pg, srv, "/jobs?new=download")
    form = pg.locator("#submit-download")
    form.wait_for()
    # Each viewport its own repo: an identical job would be the same one.
    form.locator("#submit-download-repo_id").fill(f"acme/tiny-{size}-GGUF")
    form.locator("button[type=submit]").click()
    pg.wait_for_function("() => /^#\\/jobs\\/job_[0-9a-f]+$/.test(location.hash)")
    pg.locator(".job-head .badge", has_text="failed").wait_for(timeout=60_000)
    error = pg.locator("section[aria-label=Status] .job-error")
    text = error.inner_text()
    assert f"could not reach the Hugging Face Hub at {HUB}" in text, text
    assert "copy a .gguf file into the models directory" in text and "HF_ENDPOINT" in text, text
    assert "HF_HUB_OFFLINE=1" in text, text
    assert "ConnectError" not in text and "Errno" not in text, text
    # One item per line, as the CLI prints it.
    assert len([ln for ln in text.splitlines() if ln.strip().startswith("- ")]) == 3, text
    # The raw error is not lost: it is in the job's log.
    pg.wait_for_function("() => /ConnectError/.test(document.querySelector('pre.log')?.textContent ?? '')")
    error.scroll_into_view_if_needed()
    shoot(pg, screens, f"job-download-offline-{size}")
    fits_the_width(pg)

    # The job list shows the headline only.
    open_page(pg, srv, "/jobs?kind=download")
    row = pg.locator("section[aria-label='Job list'] tbody tr").first
    row.get_by_text("could not reach the Hugging Face Hub").wait_for()
    assert "copy a .gguf" not in row.inner_text()
    watch.check()


def test_pull_without_an_owner_is_refused_before_queueing(page: tuple[Any, Any, str], srv: Server,
                                                          screens: Path) -> None:
    pg, watch, size = page

    def downloads() -> list[str]:
        body = httpx.get(f"{srv.base_url}/api/jobs?kind=download&limit=500", timeout=10).json()
        return [j["params"]["repo_id"] for j in body["data"]]

    before = downloads()
    r = httpx.post(f"{srv.base_url}/api/jobs", json={"kind": "download", "params": {"repo_id": "notarepo"}}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "params.repo_id", err
    assert "owner/name" in err["message"] and "notarepo" in err["message"], err

    cli = subprocess.run(
        [sys.executable, "-m", "supervisor", "pull", "notarepo", "--port", str(srv.port),
         "--state-dir", str(srv.state_dir)], cwd=REPO, env=srv.env(), capture_output=True, text=True, timeout=60)
    lines = (cli.stdout + cli.stderr).strip().splitlines()
    assert cli.returncode == 2, (cli.returncode, lines)
    assert len(lines) == 1 and "repo_id" in lines[0] and "owner/name" in lines[0], lines
    assert "Traceback" not in cli.stderr

    # The form puts the refusal next to the field it names.
    open_page(pg, srv, "/jobs?new=download")
    form = pg.locator("#submit-download")
    form.locator("#submit-download-repo_id").fill("notarepo")
    form.locator("button[type=submit]").click()
    field_error = form.locator("[data-field=repo_id] .field-error")
    field_error.get_by_text("owner/name").wait_for()
    assert pg.evaluate("() => location.hash").startswith("#/jobs?"), "no job page opened"
    shoot(pg, screens, f"jobs-download-refused-{size}", both=False)
    fits_the_width(pg)
    assert downloads() == before, "a refused repo id was queued"
    watch.check(allow=("400",))
