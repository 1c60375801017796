"""A flow run forked from the worker's zygote, child side: what ``python -m prefect.engine`` would have been.

The zygote (``zygote_server.py``) runs this file as ``__main__`` in each fork, after it has given the child its
own output, folder (the run's workspace root), environment (the run's whole environment: names only the zygote had
are gone) and a fresh numpy seed; Python's own ``random`` reseeds itself in every fork. What is left is what
Prefect's process worker gets by starting a new interpreter, done here in order:

1. Prefect's settings and logging as a process started now would have them: read from this environment and
   folder, the console handler on this process's own stderr (the zygote's settings were read at its import).
2. The workspace prepared as Prefect's workspace supervisor prepares it (pull steps, working folder, the
   environment they leave), the manifest written that the worker's hook runner reads.
3. Settings read again in the working folder (its ``prefect.toml``, ``.env``), then Prefect's own engine.

    <python> forked.py <manifest path> <workspace root>
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any
from uuid import UUID

__all__ = ["flow_imports", "fresh_prefect", "installed_module", "main", "preload_flows"]


def fresh_prefect() -> None:
    """Prefect's settings read again from this process's environment and folder; its logging configured again
    where they changed what it says (the handlers already write to this process's own streams: the zygote gave
    it its own stdout and stderr under the same descriptors)."""
    from prefect.context import refresh_global_settings_context
    from prefect.logging.configuration import setup_logging
    from prefect.settings import get_current_settings

    before = get_current_settings().logging
    refresh_global_settings_context()
    if get_current_settings().logging != before:
        setup_logging(incremental=False)


def _settings_here() -> bool:
    """Whether this folder holds a file Prefect reads settings from (``.env``, ``prefect.toml``, ``pyproject.toml``
    with a ``[tool.prefect]`` table)."""
    if os.path.exists(".env") or os.path.exists("prefect.toml"):
        return True
    try:
        with open("pyproject.toml", encoding="utf-8", errors="replace") as pyproject:
            return "[tool.prefect" in pyproject.read()
    except OSError:
        return False


def _flush_logs() -> None:
    import anyio
    from prefect.logging.handlers import APILogHandler

    anyio.run(APILogHandler.aflush)


def _prepare(flow_run_id: UUID, workspace_root: Path, manifest_path: Path) -> tuple[list[str] | None, str]:
    """The workspace prepared, this process moved into it; (a command to exec instead, or None; the entrypoint)."""
    import anyio
    from prefect.runner._workspace_resolver import prepare_workspace_for_flow_run
    from prefect.runner._workspace_runtime import PreparedWorkspaceManifest, write_private_model
    from prefect.runner._workspace_starter import _workspace_command, workspace_environment
    from prefect.runner._workspace_supervisor import (
        _hook_command,
        _restore_runner_environment,
        _runner_owns_environment_key,
    )
    from prefect.utilities.processutils import command_from_string, sanitize_subprocess_env

    # As the workspace supervisor does: what the runner set, a pull step may not change.
    runner_environment = {key: value for key, value in os.environ.items() if _runner_owns_environment_key(key)}
    workspace = anyio.run(prepare_workspace_for_flow_run, flow_run_id, workspace_root)
    environment = sanitize_subprocess_env(workspace_environment(workspace))
    _restore_runner_environment(environment, runner_environment)
    environment["PREFECT__FLOW_RUN_ID"] = str(flow_run_id)
    environment["PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS"] = "false"
    selected = _workspace_command(workspace, None, environment=environment)
    command = command_from_string(selected) if selected is not None else None
    environment["PREFECT__FLOW_ENTRYPOINT"] = workspace.runtime_entrypoint
    # Hooks (on_crashed, on_cancellation) run later, spawned by the worker in this same runtime.
    write_private_model(manifest_path, PreparedWorkspaceManifest(
        working_directory=workspace.working_directory, project_root=workspace.project_root,
        runtime_entrypoint=workspace.runtime_entrypoint,
        hook_command=_hook_command(command or [sys.executable, "-m", "prefect.engine"]), environment=environment))
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(workspace.working_directory)
    # As `python -m` started in the working folder with PYTHONPATH set would have its path.
    added = [entry for entry in environment.get("PYTHONPATH", "").split(os.pathsep) if entry]
    rest = [entry for entry in sys.path[1:] if entry not in added]
    sys.path[:] = [str(workspace.working_directory), *added, *rest]
    return command, workspace.runtime_entrypoint


def main() -> int:
    """Run the flow run this process was forked for; its exit status is the run's, as the engine's would be."""
    manifest_path, workspace_root = Path(sys.argv[1]), Path(sys.argv[2])
    sys.argv = [sys.argv[0]]
    sys.path[0] = str(workspace_root)
    fresh_prefect()
    prefect_environment = _prefect_names()
    try:
        flow_run_id = UUID(os.environ["PREFECT__FLOW_RUN_ID"])
        command, entrypoint = _prepare(flow_run_id, workspace_root, manifest_path)
    except Exception:  # noqa: BLE001 - said on stderr, where the worker streams it, as the supervisor says it
        traceback.print_exc(file=sys.stderr)
        _flush_logs()
        return 1
    if command is not None:  # the deployment runs in an environment of its own (uv): exec it, as Prefect does
        _flush_logs()
        os.execvpe(command[0], command, dict(os.environ))  # noqa: S606 - Prefect's own argv, no shell
    if _prefect_names() != prefect_environment or _settings_here():  # what a pull step or the folder changed
        fresh_prefect()
    from prefect.runner._workspace_runtime_bootstrap import _run_engine

    return _run_engine(entrypoint)


def _prefect_names() -> dict[str, str]:
    """The environment's Prefect settings (``PREFECT__*`` names are the run's own facts, not settings)."""
    return {name: value for name, value in os.environ.items()
            if name.startswith("PREFECT_") and not name.startswith("PREFECT__")}


def flow_imports(path: str) -> list[str]:
    """The modules a flow file imports at its top level (in its body or a ``try`` there), absolute imports only,
    in order: read with ``ast``, never run."""
    import ast

    with open(path, "rb") as source:
        tree = ast.parse(source.read(), filename=path)
    names: list[str] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return list(dict.fromkeys(names))


def installed_module(name: str, folders: list[str]) -> bool:
    """Whether ``name``'s top-level package is installed: no module of that name sits in a flow folder (the run's
    working folder, first on its path, or its flow file's: there it is the deployment's own, which each run imports
    afresh), unless it is the very files the import path finds, and this interpreter's import path finds it (the
    standard library, site-packages, a folder on PYTHONPATH, an editable install, even one inside a deployment's
    folder: a module loaded from there is stamped like any other, and an edit makes the zygote stale). Finding a
    top-level spec runs none of its code."""
    import importlib.machinery
    import importlib.util

    top = name.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    own = importlib.machinery.PathFinder.find_spec(top, folders)
    # One in a flow folder is the deployment's own, unless it is the very files the path finds (an editable
    # install whose project is the deployment's folder).
    return spec is not None and (own is None or _where(own) == _where(spec))


def _where(spec: Any) -> set[str]:
    return {os.path.realpath(place) for place in [spec.origin if spec.has_location else None,
                                                   *(spec.submodule_search_locations or [])] if place}


def preload_flows(spec: str | None) -> list[str]:
    """The zygote's load stage: import what the flow files import from outside their folders, never the files.

    ``spec``: JSON, ``{"files": [...], "folders": [...]}``, the flow files and the deployments' folders. Each
    file is parsed (``flow_imports``) and each module it names that ``installed_module`` finds is imported, so a
    fork finds it loaded; the flow file itself, and every module of its folder or its deployment's, is left for
    each run to import afresh, exactly once, as Prefect's process worker does: one deployment's import-time code
    (a metric, an atexit hook, a patch) never reaches another's runs, nor an edited file's next run. A module that
    fails to import is said and skipped; the run that imports it meets the same error where its owner sees it.
    Returns the modules imported.
    """
    import importlib
    import json

    wanted = json.loads(spec) if spec else {}
    files = [path for path in wanted.get("files") or [] if path]
    folders = sorted({os.path.realpath(folder) for folder in
                      [*(wanted.get("folders") or []), *(os.path.dirname(path) for path in files)] if folder})
    # The zygote's own folder (this file's, sys.path[0] as `python forked.py` has it) is not on a run's path.
    own = sys.path.pop(0) if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)) else None
    imported: list[str] = []
    seen: set[str] = set()
    try:
        for path in files:
            try:
                names = flow_imports(path)
            except (OSError, SyntaxError, ValueError) as exc:
                print(f"reading {path} failed, skipped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                continue
            for name in names:
                if name in seen or not installed_module(name, folders):
                    continue
                seen.add(name)
                try:
                    importlib.import_module(name)
                    imported.append(name)
                except BaseException as exc:  # noqa: BLE001 - any failure: said, and the next module is tried
                    print(f"importing {name} (imported by {path}) failed, skipped: {type(exc).__name__}: {exc}",
                          file=sys.stderr, flush=True)
    finally:
        if own is not None:
            sys.path.insert(0, own)
    print(f"preloaded {len(imported)} module(s) that {len(files)} flow file(s) import: {', '.join(imported) or 'none'}"
          " (the flow files themselves run in each flow run)", flush=True)
    return imported


if __name__ == "__main__":
    sys.exit(main())
