"""resident_pool.prefect.roots: the folders a deployment's flow run may read and write, set on the worker host."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

from resident_pool.errors import InputError
from resident_pool.prefect.roots import check_path, in_deployment
from resident_pool.settings import settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def deployed(monkeypatch):
    """This process seen as a deployment's flow run (Prefect's documented way to mock its runtime)."""
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "7b0b1f0e-0000-4000-8000-000000000000")
    assert in_deployment()


def test_a_run_started_by_hand_is_bounded_only_when_roots_are_set(tmp_path, monkeypatch):
    assert not in_deployment()
    assert check_path("/etc/passwd", "input", settings()) == Path("/etc/passwd")
    monkeypatch.setenv("RESIDENT_POOL_INPUT_ROOT", str(tmp_path))
    with pytest.raises(InputError, match="RESIDENT_POOL_INPUT_ROOT"):
        check_path("/etc/passwd", "input", settings())


@pytest.mark.usefixtures("deployed")
def test_a_deployments_run_needs_the_roots_set_on_the_worker_host(tmp_path):
    for kind, variable in (("input", "RESIDENT_POOL_INPUT_ROOT"), ("output", "RESIDENT_POOL_OUTPUT_ROOT")):
        with pytest.raises(InputError) as refused:
            check_path(tmp_path / "x.fasta", kind, settings())
        assert f"{variable} is not set in this worker's environment" in str(refused.value)
        assert "never in Prefect" in str(refused.value)


@pytest.mark.usefixtures("deployed")
def test_paths_under_the_root_pass_and_every_way_out_is_refused_naming_the_setting(tmp_path, monkeypatch):
    inbox = tmp_path / "inbox"
    (inbox / "week1").mkdir(parents=True)
    (inbox / "out").symlink_to(tmp_path)  # a link inside the root that leads out of it
    monkeypatch.setenv("RESIDENT_POOL_INPUT_ROOT", str(inbox))
    assert check_path(inbox / "week1" / "a.fasta", "input", settings()) == inbox / "week1" / "a.fasta"
    assert check_path(inbox, "input", settings()) == inbox
    for path in ("/etc/passwd", inbox / ".." / "secret.csv", inbox / "out" / "secret.csv", f"{inbox}-evil/a.csv"):
        with pytest.raises(InputError) as refused:
            check_path(path, "input", settings())
        assert "is outside" in str(refused.value) and "set RESIDENT_POOL_INPUT_ROOT on the worker host to allow " \
            "more" in str(refused.value)
    # Outputs go beside the inputs unless the operator names a folder of their own.
    assert check_path(inbox / "screened", "output", settings()) == inbox / "screened"
    monkeypatch.setenv("RESIDENT_POOL_OUTPUT_ROOT", str(tmp_path / "outbox"))
    with pytest.raises(InputError, match="RESIDENT_POOL_OUTPUT_ROOT"):
        check_path(inbox / "screened", "output", settings())
    assert check_path(tmp_path / "outbox" / "a.jsonl", "output", settings()) == tmp_path / "outbox" / "a.jsonl"


@pytest.mark.usefixtures("deployed")
def test_a_deployments_run_takes_providers_only_from_the_worker_hosts_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_MANIFESTS", str(tmp_path / "manifests"))
    assert check_path(tmp_path / "manifests", "manifests", settings()) == tmp_path / "manifests"
    with pytest.raises(InputError, match=r"is not .*RESIDENT_POOL_MANIFESTS"):
        check_path(tmp_path / "manifests" / "..", "manifests", settings())


@pytest.mark.usefixtures("prefect_harness", "deployed")
def test_the_screen_and_validate_flows_refuse_a_path_outside_the_roots(pool_dir, tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "flows"))
    from screen import screen
    from validate import validate

    monkeypatch.setenv("RESIDENT_POOL_INPUT_ROOT", str(tmp_path / "inbox"))
    state = screen(input="/etc/passwd", provider="echo", return_state=True)
    assert state.is_failed() and "/etc/passwd: is outside" in state.message, state.message
    # The providers' folder is the worker host's (RESIDENT_POOL_MANIFESTS): no flow run can name another.
    assert "manifests" not in inspect.signature(validate.fn).parameters
    assert "manifests" not in inspect.signature(screen.fn).parameters
