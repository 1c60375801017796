"""What an operator and a UI user see, in headless Chromium against one real `prefect server` (shared here).

The failure artifact on a failed task run's page; the predict flow run from the
deployment's form, its provider picked in the dropdown, its answer on the run's page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import prefect_server, stop_group, wait_until
from providers import write_provider

from resident_pool.exits import exit_hint

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The PREFECT_* variables of one real Prefect server for this file's tests."""
    with prefect_server(tmp_path_factory.mktemp("server")) as env:
        yield {name: value for name, value in env.items() if name.startswith("PREFECT_")}


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
def test_the_failed_task_runs_page_shows_the_exit_hint_and_the_transcript(server, pool_dir, tmp_path):
    chromium, sync_playwright = _browser()
    write_provider(pool_dir, "kernels", 'worker_args = ["{socket}", "--exit-before-bind", "5"]\n')
    env = {**os.environ, **server}
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


FLOW_RUNS = """
import json, sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["predict"])))
print(json.dumps([{"id": str(r.id), "state": r.state.type.value if r.state else None,
                   "parameters": r.parameters} for r in runs]))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_predict_form_offers_the_providers_and_the_run_page_shows_the_answer(server, pool_dir, tmp_path):
    chromium, sync_playwright = _browser()
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    # A slug with an underscore, whose [smoke] payload is what an empty form sends.
    write_provider(pool_dir, "esm_2", '[smoke]\npayload = { inputs = ["MKTAYIAKQRQ"] }\n', worker="embedder.py")
    env = {**os.environ, **server}
    subprocess.run([sys.executable, str(ROOT / "flows" / "deploy.py"), "--work-pool", "rp-ui", "--manifests",
                    str(pool_dir)], env=env, check=True, cwd=ROOT, timeout=120)

    def flow_runs():
        done = subprocess.run([sys.executable, "-c", FLOW_RUNS], env=env, capture_output=True, text=True, timeout=60,
                              check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "rp-ui", "--type", "process"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium, args=BROWSER_FLAGS,
                                                     env={**env, "HOME": str(tmp_path)})
                try:
                    page = browser.new_page(viewport={"width": 1400, "height": 1000})
                    page.set_default_timeout(60_000)  # each wait below polls until its element appears
                    page.goto(f"{env['PREFECT_UI_URL']}/deployments")
                    page.get_by_role("link", name="predict").first.click()
                    page.get_by_role("button", name="Run", exact=True).click()
                    page.get_by_text("Custom run").click()
                    page.get_by_text("provider (Optional)").wait_for()
                    assert page.get_by_text("manifests", exact=False).count() == 0  # not a UI parameter
                    dropdown = page.locator(".schema-form-property-string .p-select-button__control").first
                    dropdown.focus()
                    page.keyboard.press(" ")  # prefect-design's select opens from the keyboard
                    options = page.get_by_role("option")
                    options.first.wait_for()
                    offered = options.all_inner_texts()
                    page.screenshot(path=str(tmp_path / "form.png"), full_page=True)
                    page.get_by_role("option", name="esm_2").click()
                    page.get_by_role("button", name="Submit").click()
                    page.get_by_text("scheduled to start").filter(visible=True).first.wait_for()  # the toast
                    (run,) = wait_until(flow_runs, timeout=60, message="the flow run the form created")
                    wait_until(lambda: flow_runs()[0]["state"] in ("COMPLETED", "FAILED", "CRASHED"), timeout=240,
                               interval=1, message="the flow run to finish")
                    page.goto(f"{env['PREFECT_UI_URL']}/runs/flow-run/{run['id']}")
                    page.get_by_text("Artifacts", exact=True).first.click()
                    card = page.get_by_text("predict-esm-2").first
                    card.wait_for()  # the answer's artifact, on the flow run's page
                    page.screenshot(path=str(tmp_path / "run.png"), full_page=True)
                    card.click()
                    page.get_by_text("esm_2: 1 prediction(s)").first.wait_for()
                    page.get_by_text("embedding").first.wait_for()
                    body = page.inner_text("body")
                    page.screenshot(path=str(tmp_path / "answer.png"), full_page=True)
                finally:
                    browser.close()
        finally:
            stop_group(worker)
    assert offered == ["echo", "esm_2"]
    assert flow_runs()[0]["state"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]
    assert run["parameters"]["provider"] == "esm_2"
    assert run["parameters"].get("inputs") is None  # the form sent no inputs: the smoke payload was used
    assert "MKTAYIAKQRQ" in body and '"tokens": 11' in body
    assert (tmp_path / "answer.png").stat().st_size > 10_000
