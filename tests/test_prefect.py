"""resident_pool.prefect and the flows, on Prefect's test harness (a real temporary server)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import RefusingClient, breaker_open, settled_task_runs, wait_until
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterTaskRunId,
    LogFilter,
    LogFilterTaskRunId,
)
from prefect.task_runners import ThreadPoolTaskRunner
from providers import EMBEDDER_ENV, make_kit_venv, write_provider

from resident_pool import Pool, WorkerStartError
from resident_pool.prefect import apredict, failure_artifact_key, predict, retry_pool_failures

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "flows"))

pytestmark = pytest.mark.usefixtures("prefect_harness", "fresh_results")


@pytest.fixture
def fresh_results(tmp_path):
    """Task results (and so the cache) of this test alone."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
        yield


@task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_pool_failures)
def use_provider(slug, payload):
    return predict(slug, payload)


@flow
def one_task_flow(slug, payload):
    return use_provider(slug, payload)


def test_a_refusal_at_start_fails_the_task_once_with_the_failure_artifact(pool_dir):
    write_provider(pool_dir, "kernels", 'worker_args = ["{socket}", "--exit-before-bind", "5"]\n')
    state = one_task_flow("kernels", {"action": "echo"}, return_state=True)
    assert state.is_failed()
    (task_run,) = settled_task_runs(state, 1)
    assert task_run.run_count == 1  # a refusal is not retried
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run.id])))
    (artifact,) = artifacts
    assert artifact.key == failure_artifact_key("kernels") == "resident-pool-failure-kernels"
    transcript = next(Path(os.environ["RESIDENT_POOL_LOG_DIR"]).glob("kernels-*.log"))
    for expected in ("kernels", "start_failed", "| exit code | 5 |", "expected accelerator absent", str(transcript),
                     "REFUSED: testworker told to exit 5", "host"):
        assert expected in artifact.data
    with pytest.raises(WorkerStartError) as info:
        state.result()
    assert "\n" not in str(info.value) and "exit code 5" in str(info.value) and str(transcript) in str(info.value)


def test_a_worker_that_dies_mid_request_is_retried_and_then_succeeds(pool_dir, tmp_path):
    write_provider(pool_dir, "flaky", "")
    state = one_task_flow("flaky", {"action": "die_once", "marker": str(tmp_path / "died")}, return_state=True)
    assert state.is_completed(), state
    assert state.result()["survived"] is True
    (task_run,) = settled_task_runs(state, 1)
    assert task_run.run_count == 2


@pytest.mark.slow
def test_a_2000_input_campaign_survives_a_killed_worker_and_a_rerun_recomputes_nothing(pool_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDDER_MARKER", str(tmp_path / "killed"))
    write_provider(pool_dir, "embedder", EMBEDDER_ENV + "[lifecycle]\nmax_replicas = 2\n", worker="embedder.py")
    inputs = tmp_path / "inputs.jsonl"
    rows = [{"id": f"seq{n}", "sequence": f"MKV{n}"} for n in range(2000)]
    rows[1000]["sequence"] = "DIE-ONCE"
    rows[1500]["sequence"] = "RAISE"
    rows[1700]["sequence"] = ""
    inputs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "out.jsonl"
    from screen import screen

    first = screen(input=str(inputs), provider="embedder", chunk_size=100, output=str(output))
    assert (tmp_path / "killed").exists()  # the worker really died mid-campaign
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(2000))  # one record per input: none lost, none twice
    failed = {r["index"]: r["reason"] for r in records if not r["ok"]}
    assert failed == {1500: "request_failed", 1700: "bad_input"}
    assert first["ok"] == 1998 and first["missing"] == 0 and first["computed"] == 1999
    # Task runs of 100 inputs at first, grown towards a second of the model's time (TaskSizer): never more.
    assert 1 < first["chunks"] <= 20, first["chunks"]

    second = screen(input=str(inputs), provider="embedder", chunk_size=100, output=str(output))
    # Only the input the model refused is asked again (a refusal is not stored): one chunk of one input.
    assert second["computed"] == 1 and second["from_store"] == 1998 and second["chunks"] == 1
    assert len(output.read_text().splitlines()) == 2000


@task
def hold(slug, seconds):
    return predict(slug, {"action": "sleep", "seconds": seconds})


@task
def after_busy(slug, busy_slug):
    with Pool() as pool:
        wait_until(lambda: any(w["slug"] == busy_slug and w["state"] == "leased" and w["pid"]
                               for w in pool.status()["workers"]), timeout=60, message=f"{busy_slug} to be busy")
    return predict(slug, {"action": "echo", "value": "admitted"})


@flow(task_runner=ThreadPoolTaskRunner(max_workers=2))
def contended():
    first = hold.submit("a6", 1.5)
    second = after_busy.submit("b6", "a6")
    return first.result(), second.result(), first.task_run_id, second.task_run_id


def _task_lines(task_run_id, text):
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
    return [log.message for log in logs if text in log.message]


def test_two_tasks_that_cannot_both_fit_both_complete_and_the_waiter_says_why(pool_dir, monkeypatch):
    import resident_pool.prefect as helpers

    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug in ("a6", "b6"):
        write_provider(pool_dir, slug, '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n')
    held, admitted, holder_id, waiter_id = contended()
    assert held["slept"] == 1.5 and admitted["echo"] == "admitted"

    (line, *_) = wait_until(lambda: _task_lines(waiter_id, "waiting for GPU admission"), timeout=30,
                            message="the waiting task's log line")
    assert "b6 needs 6 GB" in line and "a6[0] 6 GB on GPU 0" in line and "free now GPU 0: 4 GB" in line
    assert "for flow run '" in line and "(task hold-" in line  # who holds the GPU, not just a pid
    # Both tasks ran on threads of this process, through one cached client: each cold start says its own wait.
    (waiter_start,) = wait_until(lambda: _task_lines(waiter_id, "cold start done"), timeout=30,
                                 message="the waiting task's cold start line")
    (holder_start,) = wait_until(lambda: _task_lines(holder_id, "cold start done"), timeout=30,
                                 message="the holding task's cold start line")
    assert waiter_start.startswith("b6:") and "GPU admission" in waiter_start
    assert holder_start.startswith("a6:") and "GPU admission" not in holder_start
    # Issue 32: the helpers reassigned on_wait on that shared client; each call now passes its own.
    assert helpers._clients and all(client.on_wait is None for client in helpers._clients.values())


def test_the_validation_flow_fails_on_an_altered_pin_and_passes_restored(pool_dir, tmp_path):
    import hashlib

    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.bin").write_bytes(b"weights" * 100)
    digest = hashlib.sha256(b"weights" * 100).hexdigest()
    write_provider(pool_dir, "pinned", f'[weights]\nroot = "{weights}"\n[[weights.files]]\npath = "model.bin"\n'
                                       f'sha256 = "{digest}"\nsize = 700\n')
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    from validate import validate

    (weights / "model.bin").write_bytes(b"weightz" * 100)
    state = validate(return_state=True)
    assert state.is_failed()
    assert "pinned weights" in str(state.message) and "model.bin sha256" in str(state.message)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (artifact,) = [a for a in artifacts if a.key == "resident-pool-validation"]
    table = json.loads(artifact.data)
    (row,) = [r for r in table if r["provider"] == "pinned" and r["step"] == "weights"]
    assert row["result"] == "FAILED" and digest in row["detail"]
    (weights / "model.bin").write_bytes(b"weights" * 100)
    assert validate(return_state=True).is_completed()


def test_the_validation_flow_against_stock_fails_naming_each_failed_step_with_provenance(pool_dir, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    python = make_kit_venv(tmp_path / "venv", "driftkit_opt", "toykit_opt")
    for slug, kit in (("drifting", 'name = "driftkit"\nmode = "fast"\n'), ("faithful", 'name = "toykit"\nmode = "fast"\n')):
        write_provider(pool_dir, slug, f'[env]\npython = "{python}"\n[smoke]\npayload = {{ x = 21 }}\n[kit]\n{kit}',
                       worker="toyworker.py")
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    from validate import validate

    state = validate(smoke=True, against_stock=True, return_state=True)
    assert state.is_failed()
    assert "drifting against-stock: drifting: the kit (mode fast) changes the answer" in str(state.message)
    assert "faithful" not in str(state.message) and "echo" not in str(state.message)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (artifact,) = [a for a in artifacts if a.key == "resident-pool-validation"]
    assert artifact.description.endswith("1 failed step(s): drifting against-stock")
    rows = {(r["provider"], r["step"]): r for r in json.loads(artifact.data)}
    failed = rows[("drifting", "against-stock")]
    assert failed["result"] == "FAILED" and "stock 42, kit 42.42" in failed["detail"]
    assert failed["kit"] == ("driftkit_opt 0.3 mode fast (autoload), jit key driftkit-0.3-cpu-py311; "
                             "said: driftkit_opt: ACTIVE (fused predict, mode fast); stock: kit mode off, "
                             "said: driftkit_opt: NOT ACTIVE (mode off engages no lever)")
    from resident_pool.providers.manifest import load_manifest

    assert failed["manifest"] == load_manifest(pool_dir / "drifting" / "manifest.toml").fingerprint()
    assert failed["gpu"].startswith("cpu") and failed["host"] == os.uname().nodename
    assert rows[("faithful", "against-stock")]["result"] == "ok"
    assert rows[("echo", "against-stock")]["result"] == "skipped" and rows[("echo", "smoke")]["result"] == "ok"


@task
def echo_in_subprocess(n):
    result = predict("echo", {"n": n})
    return {"worker_pid": result["pid"], "task_pid": os.getpid()}


def test_the_helpers_work_under_the_process_pool_task_runner(pool_dir):
    from prefect.task_runners import ProcessPoolTaskRunner

    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")

    @flow(task_runner=ProcessPoolTaskRunner(max_workers=2))
    def in_processes():
        return [f.result() for f in echo_in_subprocess.map(range(4))]

    results = in_processes()
    assert {r["task_pid"] for r in results} - {os.getpid()}  # tasks ran in other processes
    with Pool() as pool:
        served = sum(w["served"] for w in pool.status()["workers"])
    # Two task processes at a time hold at most two leases at once: at most two workers served all four.
    assert served == 4 and 1 <= len({r["worker_pid"] for r in results}) <= 2


def test_the_predict_flow_shows_an_answer_that_carries_arrays(pool_dir):
    """The UI's ad hoc flow with a provider answering with arrays (structure outputs): the run completes, its
    artifact names each array's dtype and shape, and the flow's result keeps the arrays themselves."""
    write_provider(pool_dir, "arrays", 'worker_args = ["{socket}"]\n', worker="arrayworker.py")
    from predict import predict as predict_flow

    def artifact(state):
        with get_client(sync_client=True) as client:
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
        return next(a.data for a in artifacts if a.type == "markdown")

    payload = {"action": "make", "dtype": "float32", "shape": [256, 256], "nbytes": 256 * 256 * 4, "hex": "0000803f"}
    state = predict_flow(provider="arrays", payload=payload, return_state=True)
    assert state.is_completed(), state.message
    text = artifact(state)
    assert "| value | float32 array, shape \\[256, 256\\]: 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, ... |" in text, text
    assert state.result()["results"][0]["value"].sum() == 256 * 256
    raw = predict_flow(provider="arrays", payload={"action": "make", "dtype": "bytes", "nbytes": 5, "hex": "ff",
                                                   "shape": [5]}, return_state=True)
    assert "| value | 5 bytes |" in artifact(raw)


def test_a_request_an_open_breaker_refuses_says_what_opened_it_when_it_closes_and_how_to_reset_it(pool_dir,
                                                                                                   monkeypatch):
    """The report: a refused run got the first run's message; "157 s more" only inside a logged traceback."""
    import resident_pool.prefect as face

    monkeypatch.setattr(face, "_client", lambda manifests: RefusingClient(breaker_open(), pool_dir))
    state = one_task_flow("kernels", {"action": "echo"}, return_state=True)
    assert state.is_failed()
    (task_run,) = settled_task_runs(state, 1)
    assert task_run.run_count == 1  # never retried: the breaker would refuse the retry too
    message = task_run.state.message
    for words in ("breaker_open", "closes in 157 s", "resident-pool stop kernels", "edit its manifest",
                  "exit code 3", "/tmp/kernels-0.log"):
        assert words in message, message
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(artifact_filter=ArtifactFilter(
            task_run_id=ArtifactFilterTaskRunId(any_=[task_run.id])))
    for words in ("kernels not started: its breaker is open", "| closes in | 157 s |",
                  "`resident-pool stop kernels`", "The start failure that opened it", "| exit code | 3 |",
                  "REFUSED: no licence for this GPU"):
        assert words in artifact.data, artifact.data
    assert "breaker_open" in artifact.description and "157 s" in artifact.description
    assert not retry_pool_failures(None, None, state)  # nor does the condition retry one on its own


def test_the_predict_flow_takes_sequences_and_answers_a_table_per_input(pool_dir):
    """The report: typing a sequence gave "not valid under any of the given schemas"; the answer was floats, one
    per line, cut off, without the other fields; a cold start logged nothing until it ended."""
    write_provider(pool_dir, "embedder", EMBEDDER_ENV, worker="embedder.py")
    from predict import predict as predict_flow

    state = predict_flow(provider="embedder", sequences=["MKTAYIAKQRQ", " MKV "], return_state=True)
    assert state.is_completed(), state.message
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (artifact,) = [a for a in artifacts if a.type == "markdown"]
    text = artifact.data
    assert artifact.key == "predict-embedder" and "## embedder: 2 sequence(s)" in text
    assert "### 1. MKTAYIAKQRQ (11 characters)" in text and "### 2. MKV (3 characters)" in text
    assert "| embedding | vector of 2, norm 1.047e+03: 11, 1047 |".replace("1.047e+03", "") not in text
    assert re.search(r"\| embedding \| vector of 2, norm [0-9.e+]+: 11, \d+ \|", text), text
    assert "| tokens | 11 |" in text and "| tokens | 3 |" in text
    run_id = state.state_details.flow_run_id
    assert f"prefect flow-run inspect {run_id}" in text
    # The whole answer is the run's persisted result: another process reads it back from the API.
    done = subprocess.run([sys.executable, "-c", READ_RESULT, str(run_id)], capture_output=True, text=True,
                          timeout=120, check=True, env={**os.environ, "PREFECT_API_URL": _api_url()})
    items = json.loads(done.stdout.strip().splitlines()[-1])
    assert [item["input"] for item in items] == ["MKTAYIAKQRQ", "MKV"] and items[0]["tokens"] == 11
    lines = wait_until(lambda: [log.message for log in _flow_logs(state) if "embedder:" in log.message and (
        "cold start done" in log.message or "answered" in log.message)] or None, timeout=30, interval=0.5,
        message="the cold start's and the answer's log lines")
    assert any(line.startswith("embedder: cold start done in") and "transcript" in line for line in lines), lines
    assert any("answered 1 request(s)" in line for line in lines), lines

    echo = predict_flow(provider="embedder", payload={"inputs": ["MKV"]}, return_state=True)
    assert echo.is_completed() and echo.result()["results"][0]["items"][0]["tokens"] == 3
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    refused = predict_flow(provider="echo", sequences=["MKV"], return_state=True)
    assert refused.is_failed() and "echo does not take sequences" in refused.message
    assert '{"ping": "hello"}' in refused.message and "give a payload" in refused.message


READ_RESULT = """
import json, sys
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    run = client.read_flow_run(sys.argv[1])
print(json.dumps(run.state.result()["items"]))
"""


def _api_url():
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _flow_logs(state):
    from prefect.client.schemas.filters import LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[state.state_details.flow_run_id])), limit=200)


def test_the_validate_flow_runs_a_task_per_provider_that_fails_with_it_failures_first_and_escaped(pool_dir):
    """The report: the run failed while its tasks (check-provider-5af ...) were green; failures were not first;
    each failure was struck through by the internal name crashy~declared-eb8681."""
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    write_provider(pool_dir, "crashy", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n'
                                       '[smoke]\npayload = { action = "echo" }\n')
    write_provider(pool_dir, "zz_fine", '[smoke]\npayload = { action = "echo" }\n')
    from validate import validate

    state = validate(smoke=True, return_state=True)
    assert state.is_failed()
    assert "1 provider(s) failed" in state.message and "crashy smoke" in state.message
    runs = {run.name: run for run in settled_task_runs(state, 3)}
    assert sorted(runs) == ["check crashy", "check echo", "check zz_fine"]
    assert runs["check crashy"].state.is_failed() and "crashy: smoke" in runs["check crashy"].state.message
    assert runs["check echo"].state.is_completed() and runs["check zz_fine"].state.is_completed()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (artifact,) = [a for a in artifacts if a.key == "resident-pool-validation"]
    table = json.loads(artifact.data)
    assert table[0]["provider"] == "crashy" and table[0]["result"] == "FAILED"
    ranks = [0 if row["result"] == "FAILED" else 1 if row["result"] == "ok" else 2 for row in table]
    assert ranks == sorted(ranks)  # failures first, then what passed, then what was skipped
    text = json.dumps(table) + artifact.description
    # User-facing names only: the check names the provider as people do (no `crashy~declared-1e2c9b`).
    assert "~" not in text.replace("\\~", "") and "declared-" not in text
    unknown = validate(providers=["../elsewhere"], return_state=True)
    assert unknown.is_failed() and "unknown provider(s) '../elsewhere'" in unknown.message


def test_artifact_keys_of_two_different_providers_differ():
    """Review of issue 15, finding 11: esm_2 and esm-2 are both valid slugs; their artifacts must not mix."""
    from resident_pool.prefect import artifact_key

    keys = {artifact_key("screen-summary", slug) for slug in ("esm_2", "esm-2", "esm__2", "esm_-2")}
    assert len(keys) == 4, keys
    assert artifact_key("screen-summary", "esm-2") == "screen-summary-esm-2"  # a clean slug's key reads as it is
    assert all(re.fullmatch(r"[a-z0-9-]+", key) for key in keys)


def test_the_predict_artifact_shows_what_was_sent_as_code_with_no_backslashes():
    """The UI showed `Sent: {"inputs": \\["MKT..."\\]}`: markdown escapes inside a code span are shown as typed.
    A backtick in the payload (or the host's name) must not end the span either."""
    from predict import Asked, markdown

    from resident_pool.prefect import code_span

    answer = {"cold": True, "replica": 0, "worker_pid": 1, "host": "vm`x", "answer_s": 0.1, "flow_run_id": "r",
              "results": [{"dim": 3}]}
    shown = markdown("minilm", Asked([{"inputs": ["MKV"], "note": "a `b` *c*"}], "its [smoke] example"), answer)
    (sent,) = [line for line in shown.splitlines() if line.startswith("Sent: ")]
    assert sent == "Sent: ``" + json.dumps({"inputs": ["MKV"], "note": "a `b` *c*"}) + "``", sent
    assert code_span("vm`x") in shown
    assert code_span("a\nb") == "`a b`" and code_span("`x`") == "`` `x` ``"


def test_a_failure_of_the_pool_itself_is_filed_under_the_provider_asked_for(pool_dir, tmp_path, monkeypatch):
    """Issue 33: a run's failure artifact was resident-pool-failure-unknown for minilm: a failure of the pool
    itself (here it cannot start: the host admission service it is told to use does not answer) names no
    provider, and the artifact must still say which provider the task asked for."""
    from prefect import flow, task

    from resident_pool.prefect import predict as pool_predict

    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    monkeypatch.setenv("RESIDENT_POOL_ADMISSION_SERVICE", str(tmp_path / "nobody.sock"))

    @task
    def ask():
        return pool_predict("echo", {"ping": "hello"})

    @flow
    def asking():
        return ask(return_state=True)

    state = asking(return_state=True)
    assert state.is_failed()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    keys = {artifact.key for artifact in artifacts}
    assert "resident-pool-failure-echo" in keys and "resident-pool-failure-unknown" not in keys, keys
    (artifact,) = [a for a in artifacts if a.key == "resident-pool-failure-echo"]
    assert "| provider | echo |" in artifact.data and "pool_start_failed" in artifact.data


# -- async tasks -------------------------------------------------------------------------------------------------
# Prefect 3.9 leaves a TCP connection to its API unclosed when an async flow run's loop ends (a flow that only awaits
# a task returning its input does it too): that one warning is let pass. A socket of the pool's left open (AF_UNIX,
# family=1) still fails the test.
_PREFECTS_CONNECTION = r"ignore:Exception ignored in. <socket.socket fd=\d+, family=2:pytest.PytestUnraisableExceptionWarning"


@pytest.fixture
def prefects_connection_collected():
    """The garbage of the test's async flow run collected at its teardown, where its warning is let pass: held by
    the test's locals (the run's state and its error), the connection was collected in whichever test of the
    process the garbage collector next ran in (seen in full runs: test_results.py, test_review_r27.py failed)."""
    yield
    gc.collect()


def prefect_async_leak(test):
    test = pytest.mark.filterwarnings(_PREFECTS_CONNECTION)(test)
    return pytest.mark.usefixtures("prefects_connection_collected")(test)


def run_async_flow(run):
    """The async flow run's final state; Prefect's unclosed connection is collected here, inside the test that lets
    its warning pass, not in whichever test the garbage collector next runs in."""
    try:
        return asyncio.run(run)
    finally:
        gc.collect()


@task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_pool_failures)
async def use_provider_async(slug, payload):
    return await apredict(slug, payload)


@task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_pool_failures)
async def use_provider_blocking(slug, payload):  # the sync helper, called from an async task
    return predict(slug, payload)


@flow
async def async_task_flow(slug, payload, blocking=False):
    return await (use_provider_blocking if blocking else use_provider_async)(slug, payload)


@prefect_async_leak
@pytest.mark.parametrize("helper", ["apredict", "predict"])
def test_a_refusal_in_an_async_task_is_not_retried_and_leaves_its_failure_artifact(pool_dir, helper):
    """On an async task Prefect reads a state's result asynchronously: retry_pool_failures was handed a coroutine,
    took it for an error not from the pool, and retried a refusal twice; and the sync helper's artifact call handed
    back a coroutine nobody awaited, so the task had no failure artifact."""
    write_provider(pool_dir, "kernels", 'worker_args = ["{socket}", "--exit-before-bind", "5"]\n')
    state = run_async_flow(async_task_flow("kernels", {"action": "echo"}, blocking=helper == "predict",
                                           return_state=True))
    assert state.is_failed()
    (task_run,) = settled_task_runs(state, 1)
    assert task_run.run_count == 1  # a refusal is not retried
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            task_run_id=ArtifactFilterTaskRunId(any_=[task_run.id])))
    assert [artifact.key for artifact in artifacts] == ["resident-pool-failure-kernels"]
    assert "| exit code | 5 |" in artifacts[0].data and "REFUSED: testworker told to exit 5" in artifacts[0].data
    assert "exit code 5" in task_run.state.message and "\n" not in task_run.state.message


@prefect_async_leak
def test_an_async_task_predicts_and_its_log_says_what_it_waits_for_with_waiting_lines_due_sooner(pool_dir,
                                                                                                  monkeypatch):
    """The waiting lines are due after 3 s, then every 10 s; 0.3 s and 0.5 s keep the cold start this test needs
    short. They come from a task on the task's own loop: no thread."""
    import resident_pool.prefect as face

    monkeypatch.setattr(face, "WAITING_FIRST_S", 0.3)
    monkeypatch.setattr(face, "WAITING_EVERY_S", 0.5)
    write_provider(pool_dir, "slowstart", 'worker_args = ["{socket}", "--load-seconds", "2"]\n')
    state = run_async_flow(async_task_flow("slowstart", {"action": "echo", "value": "async"}, return_state=True))
    assert state.is_completed(), state.message
    assert state.result()["echo"] == "async"
    (task_run,) = settled_task_runs(state, 1)

    def lines():
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run.id])))
        said = [log.message for log in logs if log.message.startswith("slowstart:")]
        return said if any("cold start done" in line for line in said) else None

    said = wait_until(lines, timeout=30, interval=0.5, message="the task's waiting and cold start lines")
    assert any("cold start in progress" in line and "is loading" in line for line in said), said
    assert any(line.startswith("slowstart: cold start done in") and "spawned" in line for line in said), said
