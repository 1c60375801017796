"""Lifecycle events: the pool's own stream, the Prefect helpers' events, and the relay between them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.ops.events import EVENTS_FILE, EventLog, Follower, stop_cause


def test_a_follower_resumes_from_its_cursor_across_a_rotation_without_repeats_or_gaps(tmp_path):
    stream, cursor = tmp_path / EVENTS_FILE, tmp_path / "cursor"
    log = EventLog(stream)
    log.emit("worker.started", "echo", 0, n=0)
    log.max_bytes = stream.stat().st_size * 6 + 10  # one rotation after the 7th event, none after the 12th
    follower = Follower(stream, cursor=cursor)  # no cursor yet: only what comes next
    assert follower.poll() == []
    seen = []
    for n in range(1, 4):
        log.emit("worker.started", "echo", 0, n=n)
    seen += [r["payload"]["n"] for r in follower.poll()]
    follower.commit()
    follower.close()
    for n in range(4, 12):  # past max_bytes: the stream rotates once while no follower runs
        log.emit("worker.started", "echo", 0, n=n)
    assert (tmp_path / f"{EVENTS_FILE}.1").exists()
    resumed = Follower(stream, cursor=cursor)
    seen += [r["payload"]["n"] for r in resumed.poll()]
    resumed.close()
    assert seen == list(range(1, 12))
    first = Follower(stream, from_start=True)
    assert [r["payload"]["n"] for r in first.poll()] == list(range(12))  # the old file, then the current one
    first.close()


def test_a_line_that_is_not_an_event_is_skipped(tmp_path):
    stream = tmp_path / EVENTS_FILE
    stream.write_text('not json\n["a list"]\n{"event": "resident-pool.pool.started", "payload": {}}\n')
    follower = Follower(stream, from_start=True)
    assert [r["event"] for r in follower.poll()] == ["resident-pool.pool.started"]
    follower.close()


@pytest.mark.parametrize(("why", "cause"), [
    ("idle for 601.2 s (idle_timeout_s = 600)", "idle"),
    ("evicted (idle) to make room for a worker needing 6 GB", "evicted"),
    ("its manifest changed (version b replaces a)", "drained"),
    ("echo[0] exited while idle: killed by SIGKILL", "died"),
    ("echo: the worker died mid-request: exit code 9; transcript /x", "died"),
    ('echo[0] is over its budget: measured 3.00 GB of GPU memory, vram_budget_gb = 2 (over_budget = "stop")',
     "over_budget"),
    ("the pool is stopping (signal SIGTERM)", "pool_stopping"),
    ("stopped by `resident-pool stop`", "stopped"),
    ("something new", "other"),
])
def test_each_way_a_worker_ends_has_a_word(why, cause):
    assert stop_cause(why) == cause


def test_the_pool_writes_started_and_stopped_with_why_to_its_stream_with_a_half_second_idle_timeout(
        pool_dir, isolated_dirs):
    write_provider(pool_dir, "brief", "[lifecycle]\nidle_timeout_s = 0.5\n")
    with Pool() as pool:
        pid = pool.predict("brief", {"action": "echo"})["pid"]
    stream = Path(isolated_dirs["logs"]) / EVENTS_FILE

    def stopped():
        records = [json.loads(line) for line in stream.read_text().splitlines()]
        return [r for r in records if r["event"] == "resident-pool.worker.stopped" and r["slug"] == "brief"]

    (record,) = wait_until(stopped, timeout=20, message="the idle retirement in the event stream")
    assert record["payload"]["cause"] == "idle" and record["payload"]["pid"] == pid
    assert record["payload"]["served"] == 1 and "idle_timeout_s = 0.5" in record["payload"]["why"]
    started = [json.loads(line) for line in stream.read_text().splitlines()
               if '"resident-pool.worker.started"' in line]
    assert [r["payload"]["pid"] for r in started] == [pid]
    assert oct(stream.stat().st_mode & 0o777) == "0o600"
    printed = subprocess.run([sys.executable, "-m", "resident_pool", "events"], capture_output=True, text=True,
                             timeout=60, check=True).stdout.splitlines()
    assert [json.loads(line)["id"] for line in printed] == [
        json.loads(line)["id"] for line in stream.read_text().splitlines()]


def _stream(isolated_dirs) -> list[dict]:
    return [json.loads(line) for line in (Path(isolated_dirs["logs"]) / EVENTS_FILE).read_text().splitlines()]


def test_a_breaker_opened_outside_a_prefect_task_is_one_breaker_open_on_its_provider_in_the_pools_stream(
        pool_dir, isolated_dirs):
    """The shipped automation fires on `resident-pool.breaker.open` about `resident-pool.provider.*`, which only the
    Prefect task helpers emitted: a breaker opened by `resident-pool warm`, a plain Pool client or the pool's own
    min_replicas start reached Prefect only as `worker.start-failed` with `breaker_opened: true` in its payload."""
    from resident_pool import WorkerStartError
    from resident_pool.errors import BreakerOpen
    from resident_pool.prefect import _prefect_event

    write_provider(pool_dir, "refuser", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n')
    with Pool() as pool:
        with pytest.raises(WorkerStartError) as opened:
            pool.predict("refuser", {"action": "echo"})
        with pytest.raises(BreakerOpen):
            pool.predict("refuser", {"action": "echo"})  # refused by the open breaker: no second opening
    (record,) = [r for r in _stream(isolated_dirs) if r["event"] == "resident-pool.breaker.open"]
    assert record["slug"] == "refuser" and record["replica"] is None
    assert record["payload"]["exit_code"] == 3 and "refusal" in record["payload"]["exit"]
    assert opened.value.details["breaker_event"] == {"id": record["id"], "occurred": record["occurred"]}
    relayed = _prefect_event(record)
    assert relayed.event == "resident-pool.breaker.open" and relayed.id == uuid.UUID(record["id"])
    assert relayed.resource.id == "resident-pool.provider.refuser"  # what the automation matches
    automations = (Path(__file__).resolve().parents[1] / "infra" / "prefect" / "automations.yaml").read_text()
    assert '"resident-pool.breaker.open"' in automations and '"resident-pool.provider.*"' in automations
    (failed,) = [r for r in _stream(isolated_dirs) if r["event"] == "resident-pool.worker.start-failed"]
    assert "breaker_opened" not in _prefect_event(failed).payload  # the opening is its own event, not a flag


# -- Prefect: the helpers' events and the relay --------------------------------------------------
def _events(prefix: str, related: str | None = None):
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    with get_client(sync_client=True) as client:
        page = client.read_events(filter=EventFilter(
            event=EventNameFilter(prefix=[prefix]),
            related=EventRelatedFilter(id=[related]) if related else None), limit=50)
    return page.events


@pytest.mark.usefixtures("prefect_harness")
def test_a_failing_start_in_a_flow_emits_request_failed_and_breaker_open_related_to_that_flow_run(pool_dir,
                                                                                                isolated_dirs):
    from prefect import flow, task

    from resident_pool.prefect import predict

    write_provider(pool_dir, "refusing", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n')

    @task
    def use(slug):
        return predict(slug, {"action": "echo"})

    @flow
    def failing():
        return use("refusing")

    state = failing(return_state=True)
    assert state.is_failed()
    run = f"prefect.flow-run.{state.state_details.flow_run_id}"

    def both():
        got = {e.event: e for e in _events("resident-pool.", related=run)}
        return got if {"resident-pool.request.failed", "resident-pool.breaker.open"} <= set(got) else None

    found = wait_until(both, timeout=60, interval=0.5,
                       message="request.failed and breaker.open related to the flow run")
    failed = found["resident-pool.request.failed"]
    assert failed.resource.id == "resident-pool.provider.refusing"
    assert failed.payload["reason"] == "start_failed" and failed.payload["exit_code"] == 3
    assert "refusal" in failed.payload["exit"]
    assert {r.role for r in failed.related if r.id == run} == {"flow-run"}
    assert found["resident-pool.breaker.open"].payload["exit_code"] == 3

    # The report: breaker.open fired on every refused run. The next run is refused by the open breaker: it
    # fails as a refusal, and says nothing of opening it.
    again = failing(return_state=True)
    assert again.is_failed()
    second = f"prefect.flow-run.{again.state_details.flow_run_id}"
    refused = wait_until(lambda: [e for e in _events("resident-pool.request.failed", related=second)], timeout=60,
                         interval=0.5, message="the refused run's request.failed")
    assert refused[0].payload["breaker_refused"] is True
    assert not _events("resident-pool.breaker.open", related=second)  # once per opening, not per refusal

    # The relay forwards the pool's own line for the same opening: under the same id, still one event in Prefect.
    from resident_pool.prefect import relay_events

    (line,) = [r for r in _stream(isolated_dirs) if r["event"] == "resident-pool.breaker.open"]
    marker = EventLog(Path(isolated_dirs["logs"]) / EVENTS_FILE).emit("test.marker")  # relayed after the opening
    relay = threading.Thread(target=relay_events, args=(Path(isolated_dirs["logs"]),),
                             kwargs={"from_start": True, "follow": False, "say": lambda _: None})
    relay.start()
    relay.join(timeout=60)
    wait_until(lambda: [e for e in _events("resident-pool.test.marker") if str(e.id) == marker["id"]], timeout=60,
               interval=0.5, message="the relayed line after the opening")
    opened = [e for e in _events("resident-pool.breaker.open") if e.resource.id == "resident-pool.provider.refusing"]
    assert [str(e.id) for e in opened] == [line["id"]], opened


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_the_relay_forwards_a_pool_side_idle_retirement_after_a_half_second_idle_timeout_to_prefect(pool_dir, tmp_path):
    from prefect.settings import PREFECT_API_URL

    write_provider(pool_dir, "retiring", "[lifecycle]\nidle_timeout_s = 0.5\n")
    relay_log = tmp_path / "relay.log"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    with open(relay_log, "w") as out:
        relay = subprocess.Popen([sys.executable, "-m", "resident_pool", "events", "--to-prefect"], env=env,
                                 stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "relaying" in relay_log.read_text(), timeout=60, interval=0.2,
                   message="the relay to start")
        with Pool() as pool:
            pid = pool.predict("retiring", {"action": "echo"})["pid"]

        def retired():
            return [e for e in _events("resident-pool.worker.stopped")
                    if e.resource.get("resident-pool.provider") == "retiring"]

        (event,) = wait_until(retired, timeout=60, interval=0.5, message="the idle retirement in Prefect's events")
        assert event.payload["cause"] == "idle" and event.payload["pid"] == pid
        assert event.resource.id.startswith("resident-pool.worker.") and event.resource.id.endswith(".retiring.0")
        assert "resident-pool.provider.retiring" in {r.id for r in event.related}
        started = [e for e in _events("resident-pool.worker.started")
                   if e.resource.get("resident-pool.provider") == "retiring"]
        assert [e.payload["pid"] for e in started] == [pid]
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    assert relay.returncode == 0, relay_log.read_text()


@pytest.mark.usefixtures("prefect_harness")
def test_the_example_automations_are_accepted_by_a_prefect_server(tmp_path):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    block = CustomWebhookNotificationBlock(name="hook", url="http://127.0.0.1:9/hook", json_data={"text": "{{body}}"})
    block_id = block.save("resident-pool-test-hook", overwrite=True)
    example = Path(__file__).resolve().parents[1] / "infra" / "prefect" / "automations.yaml"
    mine = tmp_path / "automations.yaml"
    mine.write_text(example.read_text().replace("REPLACE_WITH_YOUR_NOTIFICATION_BLOCK_ID", str(block_id)))
    done = subprocess.run([str(Path(sys.executable).with_name("prefect")), "automation", "create", "--from-file",
                           str(mine)], env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    with get_client(sync_client=True) as client:
        names = {a.name for a in client.read_automations()}
    assert {"resident-pool breaker open", "resident-pool worker over budget"} <= names


@pytest.mark.usefixtures("prefect_harness")
def test_a_task_that_waited_for_gpu_memory_and_paid_a_start_says_both(pool_dir, monkeypatch):
    from prefect import flow, task

    from resident_pool.prefect import predict

    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug in ("a6", "b6"):
        write_provider(pool_dir, slug, '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n')

    @task
    def waits_for(slug):
        return predict(slug, {"action": "echo"})

    @flow
    def behind_a_holder():
        return waits_for("b6")

    ran = {}
    with Pool() as pool:
        with pool.session("a6"):
            runner = threading.Thread(target=lambda: ran.update(state=behind_a_holder(return_state=True)))
            runner.start()
            # Until the pool has told the task what it waits for: that report is made a moment after the wait
            # shows in pool.waiting(), and one made after a6 let go said "held by nobody" (seen under load).
            pool_log = Path(os.environ["RESIDENT_POOL_LOG_DIR"]) / "pool.log"
            wait_until(lambda: [w for w in pool.waiting() if w.get("slug") == "b6"]
                       and "b6 waits for 6 GB" in pool_log.read_text(), timeout=60,
                       message="the flow's task to wait for GPU memory and be told why")
        runner.join(timeout=60)  # a6 let go: the waiting task evicts it and starts b6
    state = ran["state"]
    assert state.is_completed()
    run = f"prefect.flow-run.{state.state_details.flow_run_id}"

    def both():
        got = {e.event: e for e in _events("resident-pool.", related=run)}
        return got if {"resident-pool.admission.waited", "resident-pool.worker.cold-start"} <= set(got) else None

    found = wait_until(both, timeout=60, interval=0.5, message="admission.waited and worker.cold-start")
    waited = found["resident-pool.admission.waited"].payload
    assert waited["needs_gb"] == 6 and any("a6[0]" in h for h in waited["holders"])
    assert found["resident-pool.worker.cold-start"].resource.id == "resident-pool.provider.b6"
