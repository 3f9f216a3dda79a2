"""The engine of each model in the lab UI, in Chromium: the models page and
the chat's model picker say "llama.cpp" for a GGUF and "vLLM" for a Hugging
Face model dir (listed only: nothing is loaded)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.browser import DESKTOP, new_page
from tests.server import Server, short_tempdir
from tests.test_hf_library import write_model

pytestmark = pytest.mark.timeout(120)


def test_models_page_and_picker_show_each_engine(browser: Any, start_server: Callable[..., Server],
                                                 tiny_model_path: Path) -> None:
    models = short_tempdir("gvue")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    write_model(models / "org" / "Tiny-HF")
    # Any executable Python makes the hf model usable in the listing; it is never loaded here.
    srv = start_server(models, env={"GPUVISOR_VLLM_PYTHON": sys.executable}, wait_ready=False)
    context, pg, watch = new_page(browser, srv.base_url, DESKTOP)
    try:
        pg.goto(f"{srv.base_url}/#/models")
        for model, engine in (("tiny", "llama.cpp"), ("org/Tiny-HF", "vLLM")):
            cell = pg.locator(f'tr[data-model="{model}"] td.engine')
            cell.wait_for(timeout=15_000)
            assert cell.inner_text().strip() == engine
        assert pg.locator("table.models th", has_text="Engine").count() == 1
        pg.goto(f"{srv.base_url}/#/chat")
        for model, engine in (("tiny", "llama.cpp"), ("org/Tiny-HF", "vLLM")):
            option = pg.locator(f'#chat-model option[value="{model}"]')
            option.wait_for(state="attached", timeout=15_000)
            assert f"— {engine} · " in option.inner_text(), option.inner_text()
    finally:
        context.close()
    watch.check()
