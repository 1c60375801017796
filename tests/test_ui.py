"""What an operator sees: the failure artifact on the failed task run's page of the Prefect UI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import prefect_server
from providers import write_provider

from resident_pool.exits import exit_hint

FAILING_FLOW = """
import json
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from resident_pool.prefect import predict, retry_pool_failures

@task(retries=1, retry_condition_fn=retry_pool_failures)
def embed():
    return predict("kernels", {"inputs": ["MKV"]})

@flow
def campaign():
    return embed()

state = campaign(return_state=True)
with get_client(sync_client=True) as client:
    (run,) = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
print(json.dumps({"task_run": str(run.id), "failed": state.is_failed()}))
"""

BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed here (Debian package `chromium`; .ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (`pip install -e .[test]`)")
    return chromium, sync_playwright


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_failed_task_runs_page_shows_the_exit_hint_and_the_transcript(pool_dir, tmp_path):
    chromium, sync_playwright = _browser()
    write_provider(pool_dir, "kernels", 'worker_args = ["{socket}", "--exit-before-bind", "5"]\n')
    with prefect_server(tmp_path) as env:
        done = subprocess.run([sys.executable, "-c", FAILING_FLOW], env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        run = json.loads(done.stdout.strip().splitlines()[-1])
        assert run["failed"]
        transcript = str(next(Path(os.environ["RESIDENT_POOL_LOG_DIR"]).glob("kernels-*.log")))
        hint = exit_hint(5)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=BROWSER_FLAGS,
                                                 env={**env, "HOME": str(tmp_path)})
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(60_000)  # each wait below polls until its text appears
                page.goto(f"{env['PREFECT_UI_URL']}/runs/task-run/{run['task_run']}")
                page.get_by_text("Artifacts", exact=True).first.click()
                card = page.get_by_text("resident-pool-failure-kernels").first
                card.wait_for()
                page.get_by_text(transcript, exact=False).first.wait_for()  # on the task run's page itself
                page.screenshot(path=str(tmp_path / "task-run.png"), full_page=True)
                card.click()
                page.get_by_text("Last lines of the transcript").wait_for()
                body = page.inner_text("body")
                page.screenshot(path=str(tmp_path / "artifact.png"), full_page=True)
            finally:
                browser.close()
    assert hint in body and transcript in body
    assert "REFUSED: testworker told to exit 5" in body
    assert (tmp_path / "task-run.png").stat().st_size > 10_000
