"""The pool's process: ``python -m resident_pool.server.daemon`` (what a client starts) and `resident-pool daemon`.

A client starts a pool whenever none runs, and a test run starts hundreds: this entry imports the server and
nothing of the command line (typer, rich and every command's module cost about 0.2 s of CPU per start).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ..errors import ResidentPoolError
from ..providers.transcripts import without_controls

__all__ = ["main", "run"]

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def run(manifests: str | os.PathLike[str] | None, *, background: bool = False,
        quiet_exit_s: float | None = None) -> int:
    """Run this host's pool until it stops; the exit status. With ``background``, fork and return 0 in the caller
    once the checks that must be said at once have passed (the child serves on, in a session of its own)."""
    from ..admission.remote import probe_service
    from ..client import default_manifests
    from ..host.paths import Paths
    from ..settings import settings
    from .corelog import check_path
    from .pool import PoolServer

    config = settings()
    paths = Paths.of(config)
    try:  # before detaching: a host admission service in force that does not answer, or a core log that cannot be
        # written, is said here, where the client that starts the pool reads it at once, not in a log
        probe_service(config)
        if config.core_log is not None:
            check_path(config.core_log)
    except ResidentPoolError as exc:
        print(f"cannot start the pool: {without_controls(str(exc))}", file=sys.stderr, flush=True)
        return 2
    folder = default_manifests(manifests, config, paths)
    if background and os.fork() > 0:
        os._exit(0)  # the client that started us waits for this exit, then for the socket
    if background:
        os.setsid()
        # Detached, it writes pool.log in the log folder (its stdout and stderr too), rotated by size;
        # under systemd it logs to stderr and the journal rotates.
        from ..ops.retention import PoolLogHandler

        handler = PoolLogHandler(paths.log_dir() / "pool.log", int(config.pool_log_max_mb * 2**20))
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    else:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        server = PoolServer(folder, quiet_exit_s=quiet_exit_s, config=config)
    except ResidentPoolError as exc:  # in the log (or the journal) as one sentence, not a traceback
        logging.getLogger("resident_pool.pool").error("cannot start the pool: %s", exc)
        return 2
    # Never the folder it was started from (a shared project or scratch folder): what runs later
    # (`python -c` probes, a tool's relative path) must find nothing planted there.
    os.chdir(server.state_dir)
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resident_pool.server.daemon",
                                     description="Run this host's pool (`resident-pool daemon` does the same).")
    parser.add_argument("--manifests", type=Path, default=None)
    parser.add_argument("--background", action="store_true", help="Detach and return once started.")
    parser.add_argument("--quiet-exit-s", type=float, default=None,
                        help="Exit after this long with no workers and no clients (0: never).")
    args = parser.parse_args(argv)
    return run(args.manifests, background=args.background, quiet_exit_s=args.quiet_exit_s)


if __name__ == "__main__":
    sys.exit(main())
