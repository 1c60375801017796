"""How `make test` shares the suite among xdist workers: every test on its own, except the files listed in
ONE_WORKER_FILES, each of which goes whole to one worker (they share one stack or server and run in file order).

pytest-xdist's own `xdist_group` marks group nothing under pytest 9: loadgroup appends the group's name to
`item._nodeid`, and pytest 9 reads a node's id from elsewhere. Each such file was then run on every worker,
each worker starting its own stack, and a test that finds what an earlier test of its file left behind failed.
"""

from __future__ import annotations

import os

from helpers import run_folder
from xdist.scheduler import LoadScopeScheduling

# Files whose tests share a module-scoped stack or server and run in file order.
ONE_WORKER_FILES = frozenset({"test_ui.py", "test_deployment.py", "test_forked_runs.py", "test_review_r34.py"})


class OneWorkerPerListedFile(LoadScopeScheduling):
    """Load scheduling, with each file of ``files`` as one unit of work."""

    def __init__(self, config, log=None, files=ONE_WORKER_FILES):
        super().__init__(config, log)
        self.files = files

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return path if os.path.basename(path) in self.files else nodeid


def claim_worker(request, what: str) -> None:
    """Fail at once, naming the cause, when ``what`` (a module-scoped stack) is set up on a second xdist worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    claim = run_folder(request.config) / ("one-worker-" + "".join(c if c.isalnum() else "-" for c in what))
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        holder = claim.read_text()
        if holder != worker:
            raise AssertionError(
                f"{what} was set up on xdist workers {holder} and {worker}: its file's tests must run on one "
                f"(ONE_WORKER_FILES in tests/scheduling.py), unless {holder} crashed (see 'worker {holder} crashed' "
                "above) and xdist gave the rest of the file to another") from None
        return
    with os.fdopen(fd, "w") as out:
        out.write(worker)
