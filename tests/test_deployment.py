"""Deployments end to end on the run's real `prefect server`, a resident-process worker per test.

Warm across flow runs: two deployment runs, the second served by the worker the
first started. The nightly screen: registered with its cron over an inbox, run
twice while the inbox gains a file, computing only what is new.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import stop_group, wait_until
from providers import EMBEDDER_ENV, write_provider
from scheduling import claim_worker

from resident_pool.campaigns.inputs import InputFile
from resident_pool.host.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "flows"))
PREFECT = str(Path(sys.executable).with_name("prefect"))

# One xdist worker takes the whole file (ONE_WORKER_FILES in scheduling.py): its server and worker start once.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = """
import json, sys
from prefect.deployments import run_deployment
run = run_deployment(sys.argv[1], parameters=json.loads(sys.argv[2]), timeout=240)
print(json.dumps({"state": run.state.type.value, "message": run.state.message,
                  "result": run.state.result(raise_on_failure=False)}, default=str))
"""

DEPLOYMENTS = """
import json
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    found = {}
    for name in ("screen/screen", "validate/validate", "predict/predict"):
        deployment = client.read_deployment_by_name(name)
        found[name] = {"paused": deployment.paused, "parameters": deployment.parameters,
                       "provider": deployment.parameter_openapi_schema["properties"].get("provider"),
                       "schema": sorted(deployment.parameter_openapi_schema["properties"]),
                       "schedules": [{"cron": s.schedule.cron, "active": s.active} for s in deployment.schedules],
                       "env": deployment.job_variables.get("env"),
                       "limit": deployment.global_concurrency_limit and deployment.global_concurrency_limit.limit}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def server(prefect_harness, tmp_path_factory, request):
    """The run's real Prefect server (a `prefect server start` of its own port, shared with the other files; this
    file's work pools and deployments have names of their own): the PREFECT_* variables its processes get, with a
    home of this file's, where a flow run's persisted result is read back."""
    claim_worker(request, "test_deployment.py's deployments")
    home = tmp_path_factory.mktemp("prefect-home")
    yield {"PREFECT_API_URL": prefect_harness, "PREFECT_HOME": str(home), "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true"}


def _env(server, **extra):
    import os

    return {**os.environ, **server, **extra}


def _run(env, deployment: str, parameters: dict, log: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, deployment, json.dumps(parameters)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:] + log.read_text()[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def _worker(env, pool: str, log: Path):
    with open(log, "w") as out:
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--type", "resident-process"], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        try:
            yield worker
        finally:
            stop_group(worker)


def test_the_second_deployment_run_is_served_by_the_worker_the_first_started(server, pool_dir, tmp_path):
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    env = _env(server)
    subprocess.run([sys.executable, str(ROOT / "flows" / "deploy.py"), "--work-pool", "rp-e2e",
                    "--manifests", str(pool_dir)], env=env, check=True, cwd=ROOT, timeout=120)
    log = tmp_path / "worker.log"
    runs = []
    with _worker(env, "rp-e2e", log):
        for n in (1, 2):
            runs.append(_run(env, "predict/predict", {"provider": "echo", "payload": {"n": n}}, log))
            if n == 1:  # the first flow run's process is gone; the model worker it started is not
                flow_run_pid, worker_pid = runs[0]["result"]["flow_run_pid"], runs[0]["result"]["worker_pid"]
                wait_until(lambda pid=flow_run_pid: not pid_alive(pid), timeout=60,
                           message="the first flow run's process to exit")
                assert pid_alive(worker_pid)
    first, second = (run["result"] for run in runs)
    assert [run["state"] for run in runs] == ["COMPLETED", "COMPLETED"]
    assert first["flow_run_pid"] != second["flow_run_pid"]  # two processes
    assert first["cold"] is True and second["cold"] is False
    assert second["worker_pid"] == first["worker_pid"]  # the same warm worker
    assert second["results"] == [{"echo": {"n": 2}, "pid": first["worker_pid"]}]


def test_the_nightly_screen_is_scheduled_and_each_run_computes_only_what_the_inbox_gained(server, pool_dir, tmp_path):
    write_provider(pool_dir, "embedder", EMBEDDER_ENV, worker="embedder.py")
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    count = tmp_path / "computed.log"
    inbox = tmp_path / "inbox"
    # The worker's own environment names the providers and the folders its flow runs may use.
    env = _env(server, EMBEDDER_COUNT=str(count), RESIDENT_POOL_INPUT_ROOT=str(inbox))
    inbox.mkdir()
    (inbox / "week1.fasta").write_text("".join(f">w1-{n}\nMKV{'ACDEFGHIKL'[n % 10]}{'MNPQRSTVWY'[n // 10]}\n"
                                               for n in range(60)))
    subprocess.run([sys.executable, str(ROOT / "flows" / "deploy.py"), "--work-pool", "rp-nightly",
                    "--manifests", str(pool_dir), "--schedule", "0 2 * * *", "--inbox", str(inbox),
                    "--provider", "embedder"], env=env, check=True, cwd=ROOT, timeout=120)
    done = subprocess.run([sys.executable, "-c", DEPLOYMENTS], env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    screen, validate, predict = found["screen/screen"], found["validate/validate"], found["predict/predict"]
    assert screen["schedules"] == [{"cron": "0 2 * * *", "active": True}] and screen["paused"] is False
    assert validate["schedules"] == [{"cron": "0 3 * * *", "active": True}] and validate["paused"] is False
    assert predict["schedules"] == []
    assert validate["parameters"] == {"smoke": True, "against_stock": True}  # nightly compares answers, as CI does
    assert screen["parameters"] == {"input": str(inbox), "provider": "embedder"}
    assert screen["limit"] == 1 and predict["limit"] is None  # one scheduled screen at a time; predicts unlimited
    assert predict["provider"]["enum"] == ["echo", "embedder"] and "manifests" not in predict["schema"]
    assert predict["env"] is None and screen["env"] is None  # no job variable: the worker's environment is its own

    def computed() -> int:
        return sum(int(line) for line in count.read_text().split()) if count.exists() else 0

    log = tmp_path / "worker.log"
    with _worker(env, "rp-nightly", log):
        first = _run(env, "screen/screen", {}, log)
        assert first["state"] == "COMPLETED" and first["message"] == "60 ok, 0 failed", first
        assert computed() == 60
        (inbox / "week2.tsv").write_text("Entry\tSequence\n" + "".join(f"w2-{n}\tMKV{'ACDEFGHIKL'[n % 10]}W{n}\n"
                                                                        for n in range(15)))
        second = _run(env, "screen/screen", {}, log)
    assert second["state"] == "COMPLETED" and second["message"] == "75 ok, 0 failed", second
    assert computed() == 75  # the second night computed week2's 15, nothing of week1
    outputs = sorted(p for p in (inbox / "screened").iterdir() if not p.name.endswith(".report.html"))
    assert [p.name for p in outputs] == ["week1.fasta.embedder.jsonl", "week2.tsv.embedder.jsonl"]
    assert len(outputs[0].read_text().splitlines()) == 60 and len(outputs[1].read_text().splitlines()) == 15

    # What `make stack-up` registers (infra/local/stack.sh): the same schedules, paused.
    subprocess.run([sys.executable, str(ROOT / "flows" / "deploy.py"), "--work-pool", "rp-nightly",
                    "--manifests", str(pool_dir), "--schedule", "0 2 * * *", "--inbox", str(inbox), "--paused"],
                   env=env, check=True, cwd=ROOT, timeout=120)
    done = subprocess.run([sys.executable, "-c", DEPLOYMENTS], env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["screen/screen"]["paused"] is True and found["validate/validate"]["paused"] is True
    assert found["screen/screen"]["schedules"][0]["cron"] == "0 2 * * *"
    assert "--paused" in (ROOT / "infra" / "local" / "stack.sh").read_text()


FORM = """
import json
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    print(json.dumps({name: {"schema": d.parameter_openapi_schema, "parameters": d.parameters, "schedules": [
        {"cron": s.schedule.cron, "timezone": s.schedule.timezone, **({"parameters": s.parameters}
                                                                      if s.parameters else {})} for s in d.schedules]}
        for name in ("screen/screen", "validate/validate", "predict/predict")
        for d in [client.read_deployment_by_name(name)]}))
"""


@pytest.mark.usefixtures("prefect_harness")
def test_the_forms_describe_every_parameter_offer_described_providers_and_a_payload_form_per_provider(pool_dir,
                                                                                                        monkeypatch):
    """The report: no parameter described, all "(Optional)", the provider defaulting to echo, inputs a list/None
    toggle of blank JSON editors, manifests a form field, encoding free text, validate's providers free text."""
    from deploy import deploy_all
    from prefect.settings import PREFECT_API_URL

    for slug in ("echo", "minilm"):
        shutil.copytree(ROOT / "manifests" / slug, pool_dir / slug)
    write_provider(pool_dir, "esm_2", '[smoke]\npayload = { inputs = ["MKTAYIAKQRQ"], layer = 33 }\n',
                   worker="embedder.py")
    monkeypatch.setenv("TZ", "Europe/Berlin")
    inbox = pool_dir.parent / "inbox"
    deploy_all("rp-forms", str(pool_dir), schedule="0 2 * * *", inbox=str(inbox),
               default_input=str(inbox / "uniprot-500.fasta"))
    done = subprocess.run([sys.executable, "-c", FORM], capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for name, deployment in found.items():
        properties = deployment["schema"]["properties"]
        assert "manifests" not in properties, name  # the host's configuration, never a form field
        for parameter, schema in properties.items():
            assert schema.get("description"), f"{name}: {parameter} has no description"
            assert "anyOf" not in schema or parameter == "payload", f"{name}: {parameter} is a toggle: {schema}"
    predict = found["predict/predict"]["schema"]
    provider = predict["properties"]["provider"]
    assert provider["enum"] == ["echo", "esm_2", "minilm"] and provider["default"] == "minilm"
    assert "- **echo**: returns its payload; no model, no weights" in provider["description"]
    assert "provider" in predict["required"]  # it always has one: not shown "(Optional)"
    sequences = predict["properties"]["sequences"]
    assert sequences["type"] == "array" and sequences["items"] == {"type": "string"}
    smoke = [record.text for record in InputFile(ROOT / "manifests" / "minilm" / "smoke" / "proteins.fasta").records()]
    assert sequences["examples"] == [smoke[:2]]  # the first of its smoke set
    forms = {form["title"]: form for form in predict["properties"]["payload"]["anyOf"]}
    assert forms["minilm"]["examples"] == [{"inputs": smoke[:2], "kind": "protein"}]
    assert sorted(forms) == ["echo", "esm_2", "minilm", "none"] and forms["none"]["type"] == "null"
    assert forms["esm_2"]["properties"] == {"inputs": {"type": "array", "items": {"type": "string"}},
                                            "layer": {"type": "integer"}}
    assert forms["echo"]["examples"] == [{"ping": "hello"}]
    screen = found["screen/screen"]["schema"]["properties"]
    assert screen["encoding"]["enum"] == ["float32-base64", "array", "json"]
    assert screen["format"]["enum"] == ["jsonl", "parquet"] and screen["output"]["type"] == "string"
    providers = found["validate/validate"]["schema"]["properties"]["providers"]
    assert providers["type"] == "array" and providers["items"]["enum"] == ["echo", "esm_2", "minilm"]
    # Issue 33: the form's default input is the demo file `make stack-up` copies into the inbox, and the field
    # says which folder a file must be in and how to get one there; the night still screens the whole inbox.
    assert found["screen/screen"]["parameters"] == {"input": str(inbox / "uniprot-500.fasta")}
    said = screen["input"]["description"]
    assert f"It must lie under {inbox} on the worker's host" in said and f"cp proteins.fasta {inbox}/" in said
    assert f"The default, {inbox / 'uniprot-500.fasta'}, is the demo's 500 UniProt proteins" in said
    # Schedules carry a time zone: the host's by default (here $TZ).
    assert found["screen/screen"]["schedules"] == [{"cron": "0 2 * * *", "timezone": "Europe/Berlin",
                                                    "parameters": {"input": str(inbox)}}]
    assert found["validate/validate"]["schedules"] == [{"cron": "0 3 * * *", "timezone": "Europe/Berlin"}]
    deploy_all("rp-forms", str(pool_dir), timezone="America/Chicago")
    done = subprocess.run([sys.executable, "-c", FORM], capture_output=True, text=True, timeout=60, check=True,
                          env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert json.loads(done.stdout.strip().splitlines()[-1])["validate/validate"]["schedules"][0]["timezone"] == \
        "America/Chicago"
    with pytest.raises(ValueError, match="not a time zone"):
        deploy_all("rp-forms", str(pool_dir), timezone="Mars/Olympus")
