"""`resident-pool` as a user runs it: the installed console script, in a subprocess, with a user's defaults."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import wait_until
from providers import EMBEDDER_ENV, write_provider

from resident_pool import Pool, WorkerStartError
from resident_pool.cli.status import breaker_words
from resident_pool.version import __version__

CLI = str(Path(sys.executable).with_name("resident-pool"))
# A command that Ctrl-C reaches as in a terminal: a suite started in the background of a script inherits SIGINT
# ignored, and so would the command, which then never stops (a follower hung a whole run so; a check ran its
# 30-s smoke to the end).
AS_IN_A_TERMINAL = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.argv[1], sys.argv[1:])"]
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None, env=None, unset=()):
    # What a script piping the command gets: the terminal size pytest sets for itself is not the user's.
    unset = {"COLUMNS", "LINES", *unset} - set(env or {})
    env = {name: value for name, value in {**os.environ, **(env or {})}.items() if name not in unset}
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd, env=env)


def _said(text: str) -> str:
    """What a message says, however a box or a narrow terminal wrapped it."""
    return " ".join(text.replace("│", " ").split())


def test_version_prints_the_packages_version():
    done = _cli("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"resident-pool {__version__}"


def test_the_shipped_echo_provider_answers_through_the_console_script(isolated_dirs):
    """A worker start failed at 94b768c (Starter.run wrote self.workers, an attribute Starter did not have)."""
    done = _cli("predict", "echo", "--payload", '{"ping": "hello"}', "--manifests", str(ROOT / "manifests"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["echo"] == {"ping": "hello"}


def test_predict_takes_its_payload_as_payload_or_input_and_json_text_still_works_with_a_warning(pool_dir, tmp_path):
    write_provider(pool_dir, "echoer", "")
    payload = {"action": "echo", "value": [1, 2]}
    given = _cli("predict", "echoer", "--payload", json.dumps(payload))
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout)["echo"] == [1, 2] and given.stderr == ""
    (tmp_path / "payload.json").write_text(json.dumps(payload))
    from_file = _cli("predict", "echoer", "--input", str(tmp_path / "payload.json"))
    assert from_file.returncode == 0 and json.loads(from_file.stdout)["echo"] == [1, 2]
    old = _cli("predict", "echoer", "--json", json.dumps(payload))
    assert old.returncode == 0 and json.loads(old.stdout)["echo"] == [1, 2]
    assert "--json TEXT is deprecated" in old.stderr and "--payload" in old.stderr
    both = _cli("predict", "echoer", "--payload", "{}", "--input", str(tmp_path / "payload.json"))
    assert both.returncode == 2 and "exactly one of --payload TEXT or --input FILE" in _said(both.stderr)


def test_warm_stop_and_metrics_print_json_for_scripts(pool_dir):
    write_provider(pool_dir, "warmable", "[lifecycle]\nmax_replicas = 2\n")
    warmed = _cli("warm", "warmable", "--replicas", "2", "--json")
    assert warmed.returncode == 0, warmed.stderr
    assert json.loads(warmed.stdout) == {"slug": "warmable", "replicas": 2, "already_warm": 0, "started": 2,
                                         "errors": []}
    families = json.loads(_cli("metrics", "--json").stdout)
    up = next(family for family in families if family["name"] == "resident_pool_up")
    assert up["samples"][0]["value"] == 1.0
    cold = next(family for family in families if family["name"] == "resident_pool_cold_starts")
    assert {"name": "resident_pool_cold_starts_total", "labels": {"provider": "warmable"}, "value": 2.0} \
        in cold["samples"]
    stopped = _cli("stop", "warmable", "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert sorted(json.loads(stopped.stdout)["stopped"]) == ["warmable[0]", "warmable[1]"]
    assert json.loads(_cli("stop", "--all", "--json").stdout) == {"stopped": []}


def test_metrics_json_says_the_pool_is_down_when_none_runs(pool_dir):
    done = _cli("metrics", "--json")
    assert done.returncode == 0
    (up,) = [family for family in json.loads(done.stdout) if family["name"] == "resident_pool_up"]
    assert up["samples"][0]["value"] == 0.0 and "no pool is running" in done.stderr


def test_unknown_provider_names_exit_non_zero_everywhere(pool_dir):
    write_provider(pool_dir, "known", "")
    commands = [("stop", "nope"), ("warm", "nope"), ("logs", "nope"), ("predict", "nope", "--payload", "{}"),
                ("check", "nope")]
    for command in commands:  # no pool runs yet
        done = _cli(*command)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert f"nope: no provider of that name ({pool_dir} has known)" in done.stderr, command
    with Pool() as pool:
        pool.predict("known", {"action": "echo"})
        for command in commands:
            done = _cli(*command)
            assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert json.loads(_cli("stop", "nope", "--json").stdout)["reason"] == "unknown_provider"
        assert [w["slug"] for w in pool.status()["workers"]] == ["known"]  # nothing was stopped for it
    # A provider the pool knows stops even where the folder here lacks it; one nobody knows is refused.
    assert _cli("stop", "known").returncode == 0


def test_without_a_manifests_folder_here_the_cli_uses_the_running_pools(pool_dir, tmp_path):
    write_provider(pool_dir, "present", "")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    unset = ["RESIDENT_POOL_MANIFESTS"]  # as a user who never set it has it
    with Pool(pool_dir) as pool:
        pool.status()  # the pool runs, serving pool_dir
        warmed = _cli("warm", "present", cwd=elsewhere, unset=unset)
        assert warmed.returncode == 0, warmed.stdout + warmed.stderr
        assert "1 of 1 worker(s) warm" in warmed.stdout
        answer = _cli("predict", "present", "--payload", '{"action": "echo"}', cwd=elsewhere, unset=unset)
        assert answer.returncode == 0, answer.stderr
        checked = _cli("check", "present", cwd=elsewhere, unset=unset)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    # A ./manifests where it exists comes first, as --manifests and the variable do.
    (elsewhere / "manifests").mkdir()
    here = _cli("warm", "present", cwd=elsewhere, unset=unset)
    assert here.returncode == 1 and f"({elsewhere / 'manifests'} holds no provider)" in here.stderr


def test_check_and_status_name_providers_as_people_do_never_by_their_variant_key(pool_dir):
    write_provider(pool_dir, "refuses", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n'
                                        '[smoke]\npayload = { action = "echo" }\n')
    done = _cli("check", "--smoke", "refuses")
    assert done.returncode == 1
    assert "refuses: the worker exited before it answered: exit code 3" in done.stdout
    assert not re.search(r"(?<![/\w])refuses~", done.stdout), done.stdout  # only inside its transcript's path
    reported = json.loads(_cli("check", "--smoke", "refuses", "--json").stdout)
    (smoke,) = [r for r in reported if r["step"] == "smoke"]
    assert smoke["detail"].startswith("refuses: ") and smoke["slug"] == "refuses"
    write_provider(pool_dir, "answers", '[smoke]\npayload = { action = "echo" }\n')
    reported = json.loads(_cli("check", "--smoke", "answers", "--json").stdout)
    (smoke,) = [r for r in reported if r["step"] == "smoke"]
    assert smoke["ok"] and "(answers, the check's declared build, version" in smoke["provenance"]["smoke.worker"]


def test_status_names_a_checks_own_worker_by_its_provider(pool_dir):
    write_provider(pool_dir, "slow", '[smoke]\npayload = { action = "sleep", seconds = 30 }\n')
    check = subprocess.Popen([*AS_IN_A_TERMINAL, CLI, "check", "--smoke", "slow"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        def running():
            shown = _cli("status")
            return shown.stdout if "slow (check: declared)" in shown.stdout else None

        shown = wait_until(running, timeout=60, interval=0.5, message="the check's worker in status")
        assert not [line for line in shown.splitlines() if line.startswith("│ slow~")]
    finally:
        check.send_signal(signal.SIGINT)
        # Ctrl-C ends the check, its 30-s smoke request still in the worker: 130 from typer 0.29, 1 ("Aborted!")
        # from typer 0.12.5, which pyproject's typer>=0.12 allows
        assert check.wait(timeout=20) in (1, 130)
        with Pool() as pool:
            pool.stop(None, now=True)


def test_status_at_100_columns_keeps_the_error_readable_instead_of_one_word_per_line(pool_dir):
    write_provider(pool_dir, "busy", "")
    write_provider(pool_dir, "broken", 'worker_args = ["{socket}", "--exit-before-bind", "2"]\n')
    with Pool() as pool:
        with pytest.raises(WorkerStartError):
            pool.predict("broken", {})
        with pool.session("busy") as session:
            request = threading.Thread(target=session.predict, args=({"action": "sleep", "seconds": 2},))
            request.start()
            shown = _cli("status", env={"COLUMNS": "100"})
            request.join()
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, shown.stdout
    (broken,) = [i for i, line in enumerate(lines) if line.startswith("│ broken")]
    cells = []
    for line in lines[broken:]:
        if line.startswith("└"):
            break
        cells.append(line.rstrip("│ ").rsplit("│", 1)[-1].strip())
    assert "exit code 2" in " ".join(cells)
    assert len(cells[0].split()) >= 4 and max(len(cell) for cell in cells) >= 35, cells  # not a word a line
    assert "left out at 100 columns" in shown.stdout  # and it says what it left out


def test_status_at_80_columns_keeps_each_transcript_name_on_one_line(pool_dir):
    """The transcript column could shrink to 30 characters, and a transcript's name is its slug plus 29: at 80
    columns `vecfast-0-20261201-234633-0c2779.log` printed as `vecfast-0-20261201-234633-0c277` / `9.log`."""
    write_provider(pool_dir, "embedder", EMBEDDER_ENV, worker="embedder.py")
    warmed = _cli("warm", "embedder")
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    shown = _cli("status", env={"COLUMNS": "80"})
    (worker,) = json.loads(_cli("status", "--json").stdout)["workers"]
    assert os.path.basename(worker["transcript"]) in shown.stdout, shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80, shown.stdout


def test_logs_follow_prints_what_the_transcript_gains_and_moves_to_a_newer_one_until_ctrl_c(pool_dir, isolated_dirs):
    write_provider(pool_dir, "talker", "")
    logs = Path(isolated_dirs["logs"])
    first = logs / "talker-0-20260101-000000-aaaaaa.log"
    first.write_text("old line\n")
    (logs / "talker-x-0-20260101-000001-bbbbbb.log").write_text("another provider's\n")  # talker-x is not talker
    seen: list[str] = []
    with subprocess.Popen([*AS_IN_A_TERMINAL, CLI, "logs", "talker", "-f"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as follower:
        reader = threading.Thread(target=lambda: seen.extend(iter(follower.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            wait_until(lambda: "old line\n" in seen, timeout=30, message="the tail")
            with open(first, "a") as handle:
                handle.write("new line\n")
            wait_until(lambda: "new line\n" in seen, timeout=30, message="the appended line")
            second = logs / "talker-0-20260101-000500-cccccc.log"
            second.write_text("the next start\n")
            wait_until(lambda: "the next start\n" in seen, timeout=30, message="the newer transcript")
        finally:
            follower.send_signal(signal.SIGINT)
            try:
                follower.wait(timeout=30)
            finally:
                if follower.poll() is None:
                    follower.kill()  # never left to Popen's exit, which waits without a timeout
                    follower.wait()
            reader.join(timeout=10)
        said = follower.stderr.read()
    assert follower.returncode == 0, said
    assert seen[0] == f"==> {first} <==\n" and f"==> {second} <==\n" in seen
    assert "another provider's\n" not in seen


def test_logs_shows_and_follows_the_worker_serving_now_not_a_checks_newer_one(pool_dir, isolated_dirs):
    """Issue 33: `resident-pool logs minilm` (and -f) showed a stopped smoke worker's transcript, the newest file,
    while the serving worker ran: the pool says which worker serves."""
    from resident_pool.providers.manifest import load_manifest
    from resident_pool.validation.check import run_smoke

    write_provider(pool_dir, "talker", "")
    logs = Path(isolated_dirs["logs"])
    with Pool() as pool:
        pool.predict("talker", {"action": "echo", "value": 1})
        (serving,) = [Path(w["transcript"]) for w in pool.status()["workers"] if w["slug"] == "talker"]
        run_smoke(load_manifest(pool_dir / "talker" / "manifest.toml"), {"action": "echo", "value": 2})
        newest = sorted(logs.glob("talker-*.log"), key=lambda path: path.stat().st_mtime)[-1]
        assert newest != serving  # the check's own worker started after the serving one, and stopped
        done = _cli("logs", "talker", "--tail", "1")
        assert done.returncode == 0 and done.stdout.splitlines()[0] == f"==> {serving} <==", done.stdout
        with subprocess.Popen([*AS_IN_A_TERMINAL, CLI, "logs", "talker", "-f"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) as follower:
            try:
                first = follower.stdout.readline()
            finally:
                follower.send_signal(signal.SIGINT)
                try:
                    follower.wait(timeout=30)
                finally:
                    if follower.poll() is None:
                        follower.kill()
                        follower.wait()
        assert first == f"==> {serving} <==\n"


def test_logs_json_prints_one_object_per_line(pool_dir, isolated_dirs):
    write_provider(pool_dir, "talker", "")
    path = Path(isolated_dirs["logs"]) / "talker-0-20260101-000000-aaaaaa.log"
    path.write_text("one\ntwo\n")
    done = _cli("logs", "talker", "--json", "--tail", "1")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [{"transcript": str(path), "line": "two"}]


def test_the_breaker_reads_its_time_left_under_either_name():
    assert breaker_words({"open": True, "closes_in_s": 157.0}) == "open, closes in 157 s"
    assert breaker_words({"open": True, "open_s": 12.5}) == "open, closes in 12.5 s"
    assert breaker_words({"open": False, "open_s": 0}) == "closed"


def test_status_says_when_an_open_breaker_closes(pool_dir):
    write_provider(pool_dir, "refuser", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n')
    with Pool() as pool, pytest.raises(WorkerStartError):
        pool.predict("refuser", {})
    shown = _cli("status")
    assert re.search(r"breaker refuser: open, closes in \d+(\.\d)? s", shown.stdout), shown.stdout


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["metrics"], ["check"], ["warm", "x"],
                                     ["events"], ["logs", "x"]])
def test_a_bad_setting_ends_every_command_with_its_sentence_and_exit_2_never_a_traceback_or_success(pool_dir,
                                                                                                  command):
    """Review r39: with RESIDENT_POOL_GPU_HEADROOM_GB=x, status and metrics printed the sentence and exited 0 (status
    took it for "no pool runs"); check, warm, events and logs printed a 40-line traceback ending in it."""
    done = _cli(*command, env={"RESIDENT_POOL_GPU_HEADROOM_GB": "x"})
    said = done.stdout + done.stderr
    assert done.returncode == 2, (done.returncode, said)
    assert "Traceback" not in said, said
    assert "bad setting: RESIDENT_POOL_GPU_HEADROOM_GB='x'" in said and "fix or unset the variable" in said, said


@pytest.mark.parametrize("command", [["status", "--json"], ["metrics", "--json"], ["check", "--json"],
                                     ["warm", "x", "--json"], ["stop", "--all", "--json"],
                                     ["logs", "x", "--json"], ["cache", "prune", "--json"]])
def test_a_bad_setting_under_json_is_one_error_object_on_stdout(pool_dir, command):
    """Review r40: docs/cli.md says a failure under --json is one object on stdout, {"error", "reason"}; a bad
    RESIDENT_POOL_* setting printed its sentence on stderr only and nothing on stdout (a script reading stdout got
    no JSON at all)."""
    done = _cli(*command, env={"RESIDENT_POOL_GPU_HEADROOM_GB": "x"})
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    said = json.loads(done.stdout)
    assert said["reason"] == "bad_setting" and "RESIDENT_POOL_GPU_HEADROOM_GB='x'" in said["error"], said
    assert "fix or unset the variable" in done.stderr, done.stderr


@pytest.mark.parametrize("value", ["[/x]", "[red]x"])
def test_the_admission_service_says_a_bad_setting_as_it_is_never_as_markup(value):
    """Review r40: the admission service printed its error as rich markup: a bad value with a closing tag in it
    ended in a MarkupError traceback (exit 1), one with an opening tag was shown without it ('x', not '[red]x')."""
    done = _cli("admission-service", env={"RESIDENT_POOL_GPU_HEADROOM_GB": value})
    said = done.stdout + done.stderr
    assert done.returncode == 2, (done.returncode, said)
    assert "Traceback" not in said, said
    assert f"bad setting: RESIDENT_POOL_GPU_HEADROOM_GB={value!r}" in _said(said), said
