"""The suite's own sharing among xdist workers (tests/scheduling.py): a listed file runs whole on one worker."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import pytest
from scheduling import OneWorkerPerListedFile

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return OneWorkerPerListedFile(config, log, files={{"test_shared.py"}})
"""

TESTS = """
import time
import pytest

@pytest.mark.parametrize("n", range({count}))
def test_it(n):
    time.sleep(0.05)
"""


def test_a_listed_file_runs_whole_on_one_worker_in_file_order_while_the_rest_is_shared(tmp_path):
    """CI failed when test_ui.py's last test ran on another worker than the rest, which had started the stack's
    pool: the xdist_group marks pytest-xdist's loadgroup reads group nothing under pytest 9."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_shared.py").write_text(TESTS.format(count=8))
    (tmp_path / "test_other.py").write_text(TESTS.format(count=16))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup",
                           "-v", "-o", "addopts=", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (test_\w+)\.py::test_it\[(\d+)\]", done.stdout)
    shared = [(worker, int(n)) for worker, name, n in ran if name == "test_shared"]
    other = {worker for worker, name, _ in ran if name == "test_other"}
    assert len(shared) == 8 and len({worker for worker, _ in shared}) == 1, shared
    assert [n for _, n in shared] == list(range(8))  # in file order
    assert len(other) > 1, done.stdout[-3000:]  # the rest is still shared out


SHORT_FOLDER_TESTS = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import pytest
from helpers import short_folder

@pytest.fixture
def folder(request):
    with short_folder(request, "rp-meta-") as made:
        print("MADE", made)
        yield made

def test_passes(folder):
    pass

def test_fails(folder):
    assert False
"""


def test_a_short_folder_is_removed_after_a_test_that_passed_and_kept_after_one_that_failed(tmp_path):
    """The suite left two folders in /tmp per test, about 2,400 a run (79,000 on this machine)."""
    (tmp_path / "test_meta.py").write_text(SHORT_FOLDER_TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-o", "addopts=",
                           str(tmp_path / "test_meta.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    made = re.findall(r"MADE (\S+)", done.stdout)
    assert done.returncode == 1 and len(made) == 2, done.stdout[-3000:]
    passed, failed = made
    assert not Path(passed).exists() and Path(failed).is_dir()
    Path(failed).rmdir()
