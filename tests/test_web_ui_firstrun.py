"""First-run problems of the lab UI, checked in headless Chromium against a
real gpuvisor (two copies of the tiny model, so the chat can switch models):
job forms with labels, help and pickers; job pages that tell the truth while
running and after; Markdown answers rendered safely; saved conversations;
the API page; narrow screens; the demo model's empty state; and renamed uploads.

Every page and state is saved as a screenshot (light and dark) under the
test session's temp dir (``screens``); GPUVISOR_SCREENS_DIR gets a copy."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import screens_fixture as screens  # noqa: F401 (a fixture)
from tests.browser import DESKTOP, NARROW, new_page, shoot
from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(120)



@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    (models / "tiny-b.gguf").symlink_to(tiny_model_path)
    with running(Server(models, model="tiny")) as s:
        yield s


@pytest.fixture
def desk(browser: Any, srv: Server) -> Iterator[tuple[Any, Any]]:
    context, pg, watch = new_page(browser, srv.base_url, DESKTOP)
    yield pg, watch
    context.close()


@pytest.fixture
def narrow(browser: Any, srv: Server) -> Iterator[tuple[Any, Any]]:
    context, pg, watch = new_page(browser, srv.base_url, NARROW)
    yield pg, watch
    context.close()


def open_page(pg: Any, base: str, route: str) -> None:
    pg.goto(f"{base}/#{route}")
    pg.wait_for_selector("main h1")


def wait_job(srv: Server, job_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()
        if job["status"] not in ("queued", "running"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def no_side_scroll(pg: Any) -> None:
    width = pg.evaluate("document.documentElement.scrollWidth")
    assert width <= NARROW["width"], f"the page scrolls sideways at {NARROW['width']}px: {width}"


# ---------------------------------------------------------------- job forms

def test_job_forms_have_labels_help_and_pickers(desk: Any, srv: Server, screens: Path) -> None:
    pg, watch = desk
    open_page(pg, srv.base_url, "/jobs")
    picker = pg.locator(".segmented[aria-label='Job kind']")
    picker.locator("button").first.wait_for()
    kinds = picker.locator("button").all_inner_texts()
    assert "sleep" not in kinds, "the test-only kind is offered to users"
    assert {"dataset", "finetune", "quantize", "download", "export"} <= set(kinds)

    labels: dict[str, list[str]] = {}
    for kind in kinds:
        picker.locator(f"button[data-kind={kind}]").click()
        form = pg.locator(f"#submit-{kind}")
        form.wait_for()
        fields = form.locator(".field[data-field]:not([data-field=file])")
        assert fields.count() > 0
        for i in range(fields.count()):
            field = fields.nth(i)
            name = field.get_attribute("data-field")
            help_text = field.locator(".field-help").text_content() or ""
            assert help_text.strip(), f"{kind}.{name} has no help line"
        labels[kind] = form.locator(".field[data-field] > label, .field[data-field] .check-row label").all_text_contents()
        assert "(none)" not in form.locator("option").all_text_contents(), f"{kind} offers '(none)'"
        if kind == "finetune":
            shoot(pg, screens, "jobs-finetune-form")

    text = {k: " | ".join(v) for k, v in labels.items()}
    assert "Threads" in text["quantize"] and "Nthread" not in text["quantize"]
    assert "Projector (mmproj)" in text["download"] and "Mmproj" not in text["download"]
    assert "LoRA rank" in text["finetune"] and "Lora r" not in text["finetune"]

    picker.locator("button[data-kind=finetune]").click()
    help_text = pg.locator("#submit-finetune [data-field=model] .field-help").inner_text()
    assert "Hugging Face model directory" in help_text and "Not a GGUF file" in help_text
    # No notice when the train extra is there (as in this venv).
    assert pg.locator(".train-missing").count() == 0

    # The model field offers the library's models, and free text still works.
    picker.locator("button[data-kind=quantize]").click()
    model = pg.locator("#submit-quantize-model")
    list_id = model.get_attribute("list")
    assert list_id
    pg.wait_for_function(
        "id => [...(document.getElementById(id)?.options ?? [])].map(o => o.value).includes('tiny-b')", arg=list_id)
    model.fill("anything typed")
    assert model.input_value() == "anything typed"
    watch.check()


def test_test_kinds_on_request(desk: Any, srv: Server) -> None:
    pg, watch = desk
    open_page(pg, srv.base_url, "/jobs?testkinds=1")
    pg.locator(".segmented button[data-kind=sleep]").wait_for()
    watch.check()


def test_train_extra_missing_shows_before_submit(desk: Any, srv: Server, screens: Path) -> None:
    pg, watch = desk

    def schema(route: Any) -> None:
        body = route.fetch().json()
        for k in body["data"]:
            if k["kind"] == "finetune":
                k["available"] = False
                k["unavailable_reason"] = "finetune jobs need torch, which is not installed"
        route.fulfill(json=body)

    pg.route(re.compile(r"/api/jobs/schema$"), schema)
    open_page(pg, srv.base_url, "/jobs?new=finetune")
    notice = pg.locator("#new-job-title ~ div .train-missing")
    notice.wait_for()
    assert "make install-train" in notice.inner_text()
    assert "torch" in notice.inner_text()
    shoot(pg, screens, "jobs-train-missing", both=False)
    watch.check()


def test_train_extra_missing_from_a_refused_submit(desk: Any, srv: Server) -> None:
    pg, watch = desk

    def refuse(route: Any) -> None:
        if route.request.method != "POST":
            route.continue_()
            return
        route.fulfill(status=400, json={"error": {
            "message": "finetune jobs need torch, which are not installed: install the train extra: pip install …",
            "type": "invalid_request_error", "param": "kind", "code": "train_extra_missing"}})

    pg.route(re.compile(r"/api/jobs$"), refuse)
    open_page(pg, srv.base_url, "/jobs?new=finetune")
    pg.locator("#submit-finetune-model").fill("Qwen/Qwen2.5-0.5B-Instruct")
    pg.locator("#submit-finetune-train").fill("train.jsonl")
    pg.locator("#submit-finetune button[type=submit]").click()
    notice = pg.locator(".train-missing")
    notice.wait_for()
    assert "make install-train" in notice.inner_text()
    watch.check(allow=("400",))


# ---------------------------------------------------------------- uploads and job pages

def test_same_upload_name_and_dataset_job_page(desk: Any, srv: Server, screens: Path, tmp_path: Path) -> None:
    pg, watch = desk
    rows = [{"instruction": f"Say {i}", "input": "", "output": f"{i}"} for i in range(20)]
    data = tmp_path / "ui-dup.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def upload_and_submit() -> None:
        open_page(pg, srv.base_url, "/jobs")
        pg.locator("#dataset-file").set_input_files(str(data))
        pg.locator(".preview").get_by_text("alpaca", exact=True).wait_for()
        pg.locator("#submit-dataset button[type=submit]").click()

    upload_and_submit()
    pg.wait_for_function("() => /^#\\/jobs\\/job_/.test(location.hash)")
    first = pg.url.rsplit("/", 1)[1]
    wait_job(srv, first)

    # The same name again: the server stores it as ui-dup-1.jsonl, and the page says so.
    upload_and_submit()
    notice = pg.locator(".upload-renamed")
    notice.wait_for()
    assert "stored as ui-dup-1.jsonl" in notice.inner_text()
    assert "ui-dup.jsonl already exists" in notice.inner_text()
    shoot(pg, screens, "jobs-upload-renamed", both=False)
    assert pg.evaluate("() => location.hash") == "#/jobs", "the job waits for the user's choice"
    # Its outputs exist from the first job: reusing the file means replacing them.
    pg.locator("#submit-dataset details.more > summary").click()
    pg.locator("#submit-dataset-overwrite").check()
    notice.get_by_role("button", name="Use the existing ui-dup.jsonl").click()
    pg.wait_for_function("() => /^#\\/jobs\\/job_/.test(location.hash)")
    job_id = pg.url.rsplit("/", 1)[1]
    assert job_id != first
    job = wait_job(srv, job_id)
    assert job["status"] == "succeeded", job
    assert job["params"]["input"].endswith("/ui-dup.jsonl") or job["params"]["input"] == "ui-dup.jsonl"

    # The finished job's page: truthful stage, summary with a next step, raw JSON folded.
    pg.locator(".job-head .badge", has_text="succeeded").wait_for()
    pg.locator(".stream-state", has_text="finished").wait_for()
    assert pg.title() == "dataset · ui-dup.jsonl — gpuvisor"
    assert pg.locator(".job-head h1").inner_text() == "dataset · ui-dup.jsonl"
    stage = pg.locator("section[aria-label=Status] .stage").inner_text()
    assert stage.startswith("Finished"), stage
    assert "waiting" not in stage
    summary = pg.locator("section[aria-label=Result] .result-summary")
    summary.wait_for()
    assert "20 of 20 read" in summary.inner_text()
    assert re.search(r"\d+ train · \d+ eval", summary.inner_text())
    assert not pg.locator("section[aria-label=Result] details.raw-result pre").is_visible()
    pg.wait_for_function("() => (document.querySelector('pre.log')?.textContent ?? '') !== ''")
    assert pg.locator("pre.log").inner_text() != "(no output yet)"
    facts = pg.locator("section[aria-label=Status] dl.facts").inner_text()
    assert "Ran for" in facts and "Running for" not in facts
    shoot(pg, screens, "job-dataset-finished")

    # Next step: a finetune form with this dataset filled in.
    summary.get_by_role("link", name="Fine-tune on this dataset").click()
    pg.locator("#submit-finetune").wait_for()
    assert pg.locator("#submit-finetune-train").input_value() == job["result"]["train_path"]
    assert pg.locator(".segmented button[data-kind=finetune]").get_attribute("aria-checked") == "true"
    # The dataset picker now offers what was uploaded here.
    pg.locator(".segmented button[data-kind=dataset]").click()
    pg.wait_for_function(
        "() => [...(document.querySelector('#submit-dataset-input')?.list?.options || [])].some(o => o.value === 'ui-dup-1.jsonl')")
    watch.check()


def test_running_job_shows_live_time_then_the_outcome(desk: Any, srv: Server, screens: Path) -> None:
    pg, watch = desk
    job = httpx.post(f"{srv.base_url}/api/jobs", json={"kind": "sleep", "params": {
        "steps": 400, "step_seconds": 0.05, "tag": "ui-live"}}, timeout=10).json()
    open_page(pg, srv.base_url, f"/jobs/{job['id']}")
    pg.locator(".job-head .badge", has_text="running").wait_for()
    facts = pg.locator("section[aria-label=Status] dl.facts")
    facts.get_by_text("Running for").wait_for()
    assert "Ran for" not in facts.inner_text()
    duration = facts.locator("dd.duration")
    first = duration.inner_text()
    pg.wait_for_timeout(2200)
    later = duration.inner_text()
    assert later != first and later != "0s", (first, later)
    assert pg.title().startswith("sleep"), pg.title()
    shoot(pg, screens, "job-running", both=False)
    pg.get_by_role("button", name="Cancel").click()
    pg.locator(".job-head .badge", has_text="cancelled").wait_for()
    facts.get_by_text("Ran for").wait_for()
    stage = pg.locator("section[aria-label=Status] .stage").inner_text()
    assert stage == "Cancelled", stage
    watch.check()


def test_quantize_result_links_to_chat(desk: Any, srv: Server, screens: Path) -> None:
    pg, watch = desk
    r = httpx.post(f"{srv.base_url}/api/jobs", json={"kind": "quantize", "params": {"model": "tiny", "type": "Q8_0"}}, timeout=10)
    assert r.status_code in (200, 201), r.text
    job = wait_job(srv, r.json()["id"], timeout=90)
    assert job["status"] == "succeeded", job
    open_page(pg, srv.base_url, f"/jobs/{job['id']}")
    summary = pg.locator("section[aria-label=Result] .result-summary")
    summary.wait_for()
    assert pg.title() == "quantize · tiny.gguf — gpuvisor"
    text = summary.inner_text()
    assert re.search(r"\d+(\.\d)? (KiB|MiB|B)\b", text), text
    assert "0 MiB" not in text and "0.0 MiB" not in text
    shoot(pg, screens, "job-quantize-finished")
    summary.get_by_role("link", name="Chat with this model").click()
    pg.wait_for_function("() => location.hash.startsWith('#/chat')")
    pg.wait_for_function("m => document.querySelector('#chat-model')?.value === m", arg=job["result"]["model"])
    watch.check()


# ---------------------------------------------------------------- chat

MARKDOWN = (
    "# Plan\n\nHere is **bold**, *italic* and `inline <b>code</b>`.\n\n"
    "- first item\n- second with a [link](https://example.com/docs)\n"
    "- third <img src=x onerror=\"window.__xss=1\">\n\n"
    "1. one\n2. two\n\n"
    "```python\nprint(\"<script>window.__xss=2</script>\")\n```\n\n"
    "[evil](javascript:window.__xss=3) and done."
)


def fake_response(route: Any, resp_id: str, text: str) -> None:
    events = [{"type": "response.created", "response": {"id": resp_id}}]
    events += [{"type": "response.output_text.delta", "delta": text[i:i + 7]} for i in range(0, len(text), 7)]
    events.append({"type": "response.completed", "response": {
        "id": resp_id, "status": "completed", "usage": {"input_tokens": 5, "output_tokens": 60, "total_tokens": 65}}})
    body = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
    route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)


def test_chat_renders_markdown_safely_and_keeps_conversations(desk: Any, srv: Server, screens: Path) -> None:
    pg, watch = desk
    deleted: list[str] = []

    def responses(route: Any) -> None:
        if route.request.method == "POST":
            fake_response(route, "resp_fake_md", MARKDOWN)
        else:
            route.continue_()

    def delete(route: Any) -> None:
        deleted.append(route.request.url.rsplit("/", 1)[1])
        route.fulfill(json={"id": "resp_fake_md", "object": "response", "deleted": True})

    pg.route(re.compile(r"/v1/responses$"), responses)
    pg.route(re.compile(r"/v1/responses/resp_fake_md$"), delete)
    open_page(pg, srv.base_url, "/chat")
    pg.locator("#chat-model option", has_text="tiny").first.wait_for(state="attached")
    pg.locator("#chat-input").fill("Make a plan")
    pg.locator("#chat-input").press("Enter")
    answer = pg.locator(".msg.assistant").last
    answer.locator(".usage", has_text="out").wait_for()
    md = answer.locator(".answer-text")
    assert md.locator("h3", has_text="Plan").count() == 1
    assert md.locator("strong").inner_text() == "bold"
    assert md.locator("em").inner_text() == "italic"
    assert md.locator("p code").first.inner_text() == "inline <b>code</b>"
    assert md.locator("ul > li").count() == 3 and md.locator("ol > li").count() == 2
    link = md.locator("a", has_text="link")
    assert link.get_attribute("href") == "https://example.com/docs"
    assert "noopener" in (link.get_attribute("rel") or "")
    code = md.locator(".code-block pre code")
    assert code.inner_text() == 'print("<script>window.__xss=2</script>")'
    assert md.locator(".code-block button", has_text="Copy").is_visible()
    # Nothing from the model became markup or a script URL.
    assert md.locator("img, script, b").count() == 0
    assert "<img src=x" in md.inner_text()
    assert md.locator("a", has_text="evil").count() == 0
    assert all((a or "").startswith("https://") for a in md.locator("a").evaluate_all("els => els.map(e => e.getAttribute('href'))"))
    assert pg.evaluate("() => window.__xss") is None
    shoot(pg, screens, "chat-markdown")

    # Kept in the conversation list, across a reload; opened again as it was.
    item = pg.locator(".conversations li").first
    item.get_by_text("Make a plan").wait_for()
    pg.reload()
    pg.wait_for_selector("main h1")
    pg.locator(".conversations li .conv-open", has_text="Make a plan").click()
    pg.locator(".msg.assistant .answer-text h3", has_text="Plan").wait_for()
    assert pg.locator(".mode-note .response-id").get_attribute("data-response-id") == "resp_fake_md"
    # Continuing it sends the stored last response id.
    pg.unroute(re.compile(r"/v1/responses$"))
    pg.route(re.compile(r"/v1/responses$"), lambda r: fake_response(r, "resp_fake_2", "Sure."))
    pg.locator("#chat-input").fill("And then?")
    with pg.expect_request(lambda r: r.url.endswith("/v1/responses") and r.method == "POST") as req:
        pg.locator("#chat-input").press("Enter")
    assert json.loads(req.value.post_data)["previous_response_id"] == "resp_fake_md"
    pg.locator(".msg.assistant").nth(1).locator(".usage", has_text="out").wait_for()

    # Rename (kept across a reload), then delete (the stored responses too).
    pg.locator(".conversations li").first.get_by_role("button", name=re.compile("^Rename")).click()
    pg.locator(".conv-rename").fill("Renamed plan")
    pg.locator(".conv-rename").press("Enter")
    pg.reload()
    pg.wait_for_selector("main h1")
    pg.locator(".conversations .conv-title", has_text="Renamed plan").wait_for()
    pg.once("dialog", lambda d: d.accept())
    pg.locator(".conversations li").first.get_by_role("button", name=re.compile("^Delete")).click()
    pg.locator(".conversations .conv-title").wait_for(state="detached")
    assert pg.evaluate("() => JSON.parse(localStorage.getItem('gpuvisor.chats') || '[]').length") == 0
    pg.wait_for_function("() => true")
    for _ in range(50):
        if "resp_fake_md" in deleted:
            break
        pg.wait_for_timeout(50)
    assert "resp_fake_md" in deleted
    # resp_fake_2 was never stored on the server: its DELETE is a 404, which is fine.
    watch.check(allow=("404",))


def test_chat_switches_model_mid_conversation(desk: Any, srv: Server) -> None:
    pg, watch = desk
    open_page(pg, srv.base_url, "/chat")
    sel = pg.locator("#chat-model")
    pg.locator("#chat-model option[value=tiny-b]").wait_for(state="attached")
    sel.select_option("tiny")
    pg.locator("#chat-max-tokens").fill("8")
    pg.locator("#chat-input").fill("Hello")
    with pg.expect_response(lambda r: r.url.endswith("/v1/responses")) as first:
        pg.locator("#chat-input").press("Enter")
    assert first.value.status == 200
    pg.locator(".msg.assistant").nth(0).locator(".usage", has_text="out").wait_for()
    prev = pg.locator(".mode-note .response-id").get_attribute("data-response-id") or ""
    assert prev.startswith("resp")
    sel.select_option("tiny-b")
    pg.locator("#chat-input").fill("Again")
    with pg.expect_request(lambda r: r.url.endswith("/v1/responses") and r.method == "POST") as req:
        pg.locator("#chat-input").press("Enter")
    body = json.loads(req.value.post_data)
    assert body["model"] == "tiny-b" and body["previous_response_id"] == prev
    second = pg.locator(".msg.assistant").nth(1)
    second.locator(".usage", has_text="out").wait_for()
    assert second.locator(".who").inner_text().lower() == "tiny-b"
    assert not second.locator(".notice.error").count()
    watch.check()


def test_chat_model_states_follow_the_server(desk: Any, srv: Server) -> None:
    pg, watch = desk
    httpx.post(f"{srv.base_url}/api/models/tiny/load", json={}, timeout=60).raise_for_status()
    open_page(pg, srv.base_url, "/chat")
    opt = pg.locator("#chat-model option[value=tiny]")
    opt.wait_for(state="attached")
    # "<model> — <engine> · <state>" (chat-models.js)
    assert opt.inner_text() == "tiny — llama.cpp · loaded", opt.inner_text()
    # Unloaded behind the page's back: the picker says so within a poll.
    httpx.post(f"{srv.base_url}/api/models/tiny/unload", json={}, timeout=60).raise_for_status()
    pg.wait_for_function(
        "() => /loads on first use/.test(document.querySelector('#chat-model option[value=tiny]')?.textContent ?? '')", timeout=15_000)
    watch.check()


def test_mobile_chat_continuing_note_fits(narrow: Any, srv: Server, screens: Path) -> None:
    pg, watch = narrow
    pg.route(re.compile(r"/v1/responses$"),
             lambda r: fake_response(r, "resp_" + "0123456789abcdef" * 4, MARKDOWN)
             if r.request.method == "POST" else r.continue_())
    open_page(pg, srv.base_url, "/chat")
    pg.locator("#chat-model option[value=tiny]").wait_for(state="attached")
    pg.locator("#chat-input").fill("Make a plan")
    pg.locator("#chat-input").press("Enter")
    pg.locator(".msg.assistant .usage", has_text="out").wait_for()
    pg.locator(".chat-settings summary").click()
    note = pg.locator(".mode-note")
    note.locator(".response-id").wait_for()
    card = pg.locator(".chat-settings").bounding_box()
    box = note.bounding_box()
    assert box["x"] + box["width"] <= card["x"] + card["width"] + 0.5, (box, card)
    no_side_scroll(pg)
    pg.locator(".chat-settings summary").click()
    shoot(pg, screens, "chat-mobile")
    watch.check()


# ---------------------------------------------------------------- API page

def test_api_page(desk: Any, srv: Server, screens: Path) -> None:
    pg, watch = desk
    open_page(pg, srv.base_url, "/")
    pg.locator("nav.primary a", has_text="API").click()
    pg.locator("#api-model option[value=tiny-b]").wait_for(state="attached")
    base = srv.base_url + "/v1"
    assert pg.locator("#api-base").inner_text() == base
    pg.locator("#api-model").select_option("tiny-b")
    for snippet in ("curl", "python", "javascript"):
        code = pg.locator(f"[data-snippet={snippet}] pre").inner_text()
        assert "tiny-b" in code and (base in code), (snippet, code)
    assert "Authorization: Bearer" in pg.locator("[data-snippet=curl] pre").inner_text()
    assert "Authorization: Bearer" in pg.locator("main").inner_text()
    href = pg.locator("a.openapi-link").evaluate("a => a.href")
    assert href == srv.base_url + "/openapi.json"
    assert httpx.get(href, timeout=10).status_code == 200
    shoot(pg, screens, "api")
    watch.check()


# ---------------------------------------------------------------- narrow screens, overview

def test_narrow_tables_keep_actions_on_screen(narrow: Any, srv: Server, screens: Path) -> None:
    pg, watch = narrow
    httpx.post(f"{srv.base_url}/api/models/tiny/load", json={}, timeout=60).raise_for_status()
    open_page(pg, srv.base_url, "/models")
    row = pg.locator('tr[data-model="tiny"]')
    button = row.get_by_role("button", name="Unload")
    button.wait_for()
    box = button.bounding_box()
    assert box and 0 <= box["x"] and box["x"] + box["width"] <= NARROW["width"], box
    no_side_scroll(pg)
    shoot(pg, screens, "models-narrow", full_page=True)

    open_page(pg, srv.base_url, "/")
    loaded = pg.locator("section[aria-label='Loaded models']")
    loaded.locator('tr[data-model="tiny"]').wait_for()
    cell = loaded.locator('tr[data-model="tiny"] td.keepalive')
    box = cell.bounding_box()
    assert box and box["x"] + box["width"] <= NARROW["width"], box
    assert cell.inner_text().strip()
    no_side_scroll(pg)
    shoot(pg, screens, "overview-narrow", full_page=True)

    open_page(pg, srv.base_url, "/jobs")
    pg.locator("section[aria-label='Job list'] table tbody tr").first.wait_for()
    link = pg.locator("section[aria-label='Job list'] tbody tr a").first.bounding_box()
    assert link and link["x"] + link["width"] <= NARROW["width"], link
    no_side_scroll(pg)
    shoot(pg, screens, "jobs-narrow", full_page=True)
    watch.check()


def test_overview_lists_failed_models_apart(desk: Any, srv: Server, screens: Path) -> None:
    pg, watch = desk

    def models(route: Any) -> None:
        body = route.fetch().json()
        broken = dict(body["data"][0], id="broken-model", state="failed", usable=True,
                      reason="out of memory while loading", size_bytes=123 << 20, fit={"needed_bytes": 456 << 20},
                      worker=None, keep_alive_expires_at=None, load=None)
        body["data"].append(broken)
        route.fulfill(json=body)

    pg.route(re.compile(r"/api/models$"), models)
    open_page(pg, srv.base_url, "/")
    card = pg.locator("section[aria-label='Loaded models']")
    failed = card.locator(".failed-models li[data-failed-model=broken-model]")
    failed.wait_for()
    assert "out of memory while loading" in failed.inner_text()
    assert card.locator("table").get_by_text("broken-model").count() == 0
    assert "456" not in card.inner_text() and "123" not in card.inner_text()
    shoot(pg, screens, "overview-failed", both=False)
    watch.check()


def test_overview_with_only_the_demo_model(browser: Any, start_server: Any, screens: Path) -> None:
    models = short_tempdir("gvm")
    srv = start_server(models, env={"GPUVISOR_WRITE_DEMO_MODEL": "true"})
    context, pg, watch = new_page(browser, srv.base_url, DESKTOP)
    try:
        open_page(pg, srv.base_url, "/")
        card = pg.locator("section[aria-label='Getting started']")
        card.wait_for()
        text = card.inner_text()
        assert "tiny-random-demo" in text and "random weights" in text
        assert card.locator(".models-dir").inner_text() == str(models.resolve())
        for repo in ("ggml-org/gemma-3-270m-it-GGUF", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "bartowski/SmolLM2-360M-Instruct-GGUF"):
            assert f".venv/bin/gpuvisor pull {repo}" in text
        pg.locator("section[aria-label=Service] .badge", has_text="ok").wait_for()
        shoot(pg, screens, "overview-demo")
        pg.set_viewport_size(NARROW)
        no_side_scroll(pg)
        shoot(pg, screens, "overview-demo-narrow", full_page=True, both=False)
        watch.check()
    finally:
        context.close()
