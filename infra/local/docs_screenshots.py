"""Take the manual's UI screenshots: a local stack on a free port, headless Chromium, docs/img/*.png.

    make docs-screenshots        (never run by a test: the pictures are for people)

The stack is `infra/local/stack.sh up` with its own port, folders and pool, so a stack
you run already is left alone; it is taken down again whatever happens. Needs Debian's
`chromium` (playwright, in the test extra, drives it; it downloads no browser).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "img"
VIEWPORT = {"width": 1280, "height": 800}
BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WAIT_MS = 120_000

FLOW_RUN_STATE = """
import json, sys
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    run = client.read_flow_run(sys.argv[1])
print(json.dumps({"state": run.state.type.value if run.state else None}))
"""
NEWEST_RUN = """
import json
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.client.schemas.sorting import FlowRunSort
with get_client(sync_client=True) as client:
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["predict"])),
                                 sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
print(json.dumps([str(run.id) for run in runs]))
"""


def say(message: str) -> None:
    print(f"docs-screenshots: {message}", flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def python(code: str, env: dict[str, str], *args: str):
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def poll(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")


def shoot(page, name: str) -> None:
    path = IMAGES / f"{name}.png"
    page.screenshot(path=str(path))
    say(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB)")


def take(env: dict[str, str], ui: str, chromium: str, auth: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=BROWSER_FLAGS, env=env)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(WAIT_MS)
            page.goto(f"{ui}/deployments")
            page.locator("input[type=password]").wait_for()  # the server has an auth string: its login page
            page.wait_for_load_state("networkidle")  # the UI's own first calls, refused, toast their failure
            page.evaluate("document.querySelectorAll('.p-toast, [class*=toast]').forEach(e => e.remove())")
            shoot(page, "ui-login")
            page.locator("input[type=password]").fill(auth)
            page.get_by_role("button", name="Login").click()
            page.goto(f"{ui}/deployments")
            page.get_by_role("link", name="predict").first.wait_for()
            shoot(page, "ui-deployments")
            page.get_by_role("link", name="predict").first.click()
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run").click()
            page.get_by_role("button", name="Submit").wait_for()
            shoot(page, "ui-predict-form")
            page.go_back()
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Quick run").click()
            # Prefect's Quick run shows the form with its defaults filled when a deployment has parameters:
            # its own Run button (in the dialog, beside Close) sends it.
            page.get_by_role("button", name="Close").locator("xpath=..").get_by_role("button", name="Run").click()
            page.get_by_text("scheduled to start").filter(visible=True).first.wait_for()
            (run,) = poll(lambda: python(NEWEST_RUN, env), 60, "the flow run the quick run created")
            state = poll(lambda: python(FLOW_RUN_STATE, env, run)["state"] in ("COMPLETED", "FAILED", "CRASHED")
                         and python(FLOW_RUN_STATE, env, run)["state"], 600, "the predict run to finish")
            say(f"the predict run ended {state}")
            page.goto(f"{ui}/runs/flow-run/{run}")
            page.get_by_text("Artifacts", exact=True).first.click()
            link = page.locator("a[href*='/artifacts/artifact/']").first
            link.wait_for()
            page.set_viewport_size({"width": VIEWPORT["width"], "height": 1000})  # the card below the graph
            shoot(page, "ui-run-artifacts")
            page.set_viewport_size(VIEWPORT)
            page.goto(ui + link.get_attribute("href"))
            page.get_by_text("its [smoke] example").first.wait_for()
            page.wait_for_load_state("networkidle")
            shoot(page, "ui-answer")
        except Exception:
            shoot(page, "failed")  # what the page showed when a wait ran out (not a picture of the docs)
            raise
        finally:
            browser.close()


def main() -> int:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        say("needs Debian's Chromium: `apt-get install chromium`; no screenshot was taken")
        return 1
    try:
        import playwright  # noqa: F401
    except ImportError:
        say("needs playwright (`pip install -e '.[test]'`); no screenshot was taken")
        return 1
    IMAGES.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rp-shots-"))
    port = free_port()
    env = {**os.environ, "PREFECT_PORT": str(port), "STACK_DIR": str(scratch / "stack"), "HOME": str(scratch),
           "PREFECT_HOME": str(scratch / "prefect-home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "RESIDENT_POOL_STATE_DIR": str(scratch / "state"), "RESIDENT_POOL_LOG_DIR": str(scratch / "logs"),
           "RESIDENT_POOL_RESULTS_DIR": str(scratch / "results"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("RESIDENT_POOL_MANIFESTS", None)  # the checkout's own providers, as `make stack-up` has them
    stack = [str(ROOT / "infra" / "local" / "stack.sh")]
    say(f"starting a local stack on port {port} in {scratch}")
    up = subprocess.run([*stack, "up"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    print(up.stdout + up.stderr, end="", flush=True)
    try:
        if up.returncode != 0:
            say(f"the local stack did not come up (exit {up.returncode}); its logs are in {scratch / 'stack'}; "
                "no screenshot was taken")
            return 1
        auth = (scratch / "stack" / "auth").read_text()  # what the UI's login page asks for
        env["PREFECT_API_AUTH_STRING"] = auth
        take(env, f"http://127.0.0.1:{port}", chromium, auth)
    finally:
        subprocess.run([*stack, "down"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        subprocess.run([sys.executable, "-c", "from resident_pool.client import shutdown_pool; shutdown_pool()"],
                       env=env, cwd=scratch, timeout=120, check=False)
        say(f"the stack is down; its logs stay in {scratch / 'stack'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
