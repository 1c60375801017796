"""The resident-process worker's parts that need no server: its type, its locked template, the Prefect releases
it forks under, which flow files its zygote preloads, and how a fork reads Prefect's settings again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from prefect.workers.base import BaseWorker

from resident_pool.prefect.forking import flow_files
from resident_pool.prefect.worker import WORKER_TYPE, ResidentProcessWorker, locked_job_template, prefect_refusal


def test_prefect_finds_the_worker_type_through_the_entry_point_and_its_default_template_is_locked():
    assert BaseWorker.get_worker_class_from_type(WORKER_TYPE) is ResidentProcessWorker
    template = ResidentProcessWorker.get_default_base_job_template()
    assert template == locked_job_template()  # a pool the worker creates by itself is locked too
    variables = template["variables"]
    assert sorted(variables["properties"]) == ["labels", "name", "stream_output"]
    assert variables["additionalProperties"] is False
    assert not {"command", "env", "working_dir"} & set(template["job_configuration"])


def test_outside_the_pinned_prefect_releases_the_worker_says_it_runs_flow_runs_as_the_process_worker_does():
    assert prefect_refusal("3.9.1") is None and prefect_refusal("3.9.7") is None
    for version in ("3.10.0", "3.8.8", "4.0.0", "not-a-version"):
        said = prefect_refusal(version)
        assert said and f"Prefect {version} is outside >=3.9.1,<3.10" in said
        assert "starts as Prefect's process worker starts it" in said


def _deployment(directory: Path, entrypoint: str):
    step = {"prefect.deployments.steps.set_working_directory": {"directory": str(directory)}}
    return SimpleNamespace(entrypoint=entrypoint, pull_steps=[step])


def test_the_zygote_preloads_only_local_flow_files_that_nobody_else_may_write(tmp_path):
    mine, open_to_all = tmp_path / "mine", tmp_path / "shared"
    for folder in (mine, open_to_all):
        folder.mkdir()
        (folder / "flow.py").write_text("X = 1\n")
    os.chmod(open_to_all / "flow.py", 0o666)  # another user could put code in it that the zygote would run
    git = SimpleNamespace(entrypoint="flow.py:f", pull_steps=[{"prefect.deployments.steps.git_clone": {}}])
    found = flow_files([_deployment(mine, "flow.py:f"), _deployment(open_to_all, "flow.py:f"), git,
                        _deployment(mine, "missing.py:f"), _deployment(mine, "flow.py:f")])
    assert found == [str((mine / "flow.py").resolve())]


FRESH = textwrap.dedent("""
    import json, os, sys
    os.environ["PREFECT_TASKS_DEFAULT_RETRIES"] = "5"
    from prefect.settings import get_current_settings
    from resident_pool.prefect.forked import fresh_prefect
    seen = [get_current_settings().tasks.default_retries]
    del os.environ["PREFECT_TASKS_DEFAULT_RETRIES"]  # a name the zygote had and the run has not
    seen.append(get_current_settings().tasks.default_retries)  # cached at import: still 5
    fresh_prefect()
    seen.append(get_current_settings().tasks.default_retries)
    os.chdir(sys.argv[1])  # a working folder with a prefect.toml
    fresh_prefect()
    seen.append(get_current_settings().tasks.default_retries)
    print(json.dumps(seen))
""")


def test_a_fork_reads_prefects_settings_again_removals_and_its_folders_prefect_toml_included(tmp_path):
    (tmp_path / "prefect.toml").write_text("[tasks]\ndefault_retries = 7\n")
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_TASKS")}
    done = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120, check=True, cwd=Path(__file__).parent)
    assert done.stdout.strip().splitlines()[-1] == "[5, 5, 0, 7]"


PRELOAD = textwrap.dedent("""
    import json, sys
    from resident_pool.prefect.forked import preload_flows
    ran = preload_flows(sys.argv[1])
    print(json.dumps({"ran": ran, "modules": sorted(name for name in ("colorsys", "helpers", "flow", "one_pkg",
                                                                        "sibling", "lib_mod", "wave") if name in sys.modules),
                      "marker": getattr(json, "flow_ran", False)}))
""")


def test_preloading_imports_what_flows_import_from_installs_never_the_flow_files_or_their_own_modules(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "lib_mod.py").write_text("VALUE = 1\n")
    (lib / "helpers.py").write_text("WHO = 'installed'\n")  # shadowed by each deployment's own helpers.py
    flows = []
    for name in ("one", "two"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "helpers.py").write_text(f"WHO = {name!r}\n")
        (folder / "sibling.py").write_text("import json\njson.flow_ran = True\n")
        (folder / "flow.py").write_text(textwrap.dedent("""
            import json
            import colorsys
            import helpers
            import sibling
            from lib_mod import VALUE
            from . import nothing
            try:
                import no_such_module
            except ImportError:
                pass
            json.flow_ran = True  # import-time code: never run in the zygote


            def later():
                import wave
        """))
        flows.append(str(folder / "flow.py"))
    broken = tmp_path / "three" / "broken.py"
    broken.parent.mkdir()
    broken.write_text("import (\n")
    spec = json.dumps({"files": [*flows, str(broken)], "folders": []})
    env = {**os.environ, "PYTHONPATH": str(lib)}
    done = subprocess.run([sys.executable, "-c", PRELOAD, spec], capture_output=True, text=True, timeout=120,
                          check=True, env=env)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # Installed modules (the standard library's, one on PYTHONPATH) only; no flow file, no module beside one
    # (helpers shadows the installed one in the run, so it is not preloaded either), nothing inside a function.
    assert seen == {"ran": ["json", "colorsys", "lib_mod"], "modules": ["colorsys", "lib_mod"], "marker": False}
    assert f"reading {broken} failed, skipped: SyntaxError" in done.stderr


def test_a_flow_file_reads_its_top_level_imports_without_running(tmp_path):
    from resident_pool.prefect.forked import flow_imports, installed_module

    (tmp_path / "flow.py").write_text("import os.path, json as j\nfrom prefect.states import Completed\n"
                                      "if True:\n    import wave\nraise SystemExit('never run')\n")
    (tmp_path / "mine.py").write_text("")
    assert flow_imports(str(tmp_path / "flow.py")) == ["os.path", "json", "prefect.states"]
    assert installed_module("prefect.states", [str(tmp_path)]) and installed_module("json", [str(tmp_path)])
    assert not installed_module("mine", [str(tmp_path)]) and not installed_module("no_such_module_r34", [])
