"""Outside review of issues 23 (code written to the original design) and 24 (trust, third round).

Each test is one defect found by trying to break what was built; each failed at the reviewed commit and passes
since the fixes. Workers, kits and callers are those of tests/original/ (written from the original design's three
reference files alone); the hostile worker is tests/workers/hostile_items.py. Three of the review's defects
(stack.sh's auth string sent to a port squatter, a hard link in another user's folder, a build_command argv of
paths) are tested once, by their fixes' own tests in test_stack.py, test_inputs.py and test_original_design.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import wait_listening
from providers import make_kit_venv, write_provider

from resident_pool.providers.worker_process import PROTOCOL_PATH, WORKER_BASE_PATH

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).parent / "original"  # code written to the original design, shared with its own suite
KITS = HERE / "kits"
STACK = ROOT / "infra" / "local" / "stack.sh"
sys.path.insert(0, str(ROOT / "flows"))


# -- at HEAD (94b768c): no pool starts any worker ------------------------------------------------------------------


def test_review_a_pool_starts_a_plain_worker_at_all(pool_dir):
    """server/starts.py:54 writes ``self.workers[...]`` on the Starter, which has no ``workers``: every first start
    of a replica fails with AttributeError, so every pool, CLI and Prefect path of both issues is down at HEAD."""
    from resident_pool import Pool

    write_provider(pool_dir, "echo", "")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("echo", {"x": 1})
        pool.stop("echo")
    assert answer is not None


# -- issue 24: the stack's auth string goes to whoever holds its port ------------------------------------------------

SQUATTER = textwrap.dedent("""
    import http.server, json, sys
    log = open(sys.argv[2], "a", buffering=1)
    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            size = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(size)
            log.write(json.dumps({"path": self.path, "authorization": self.headers.get("Authorization")}) + "\\n")
            body = b"true" if "health" in self.path else b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = answer
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# -- issue 24: inputs opened, never followed ----------------------------------------------------------------------


# -- issue 24: bounded by the operator, not by the input ----------------------------------------------------------

COUNT = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
    from resident_pool.campaigns.inputs import InputFile
    source = InputFile(sys.argv[1], max_input_bytes=1_000_000)
    source.check()  # passes: a header, then a field longer than the sniff
    print("records", source.record_count(), flush=True)
""")


@pytest.mark.timeout(300)
def test_review_a_sparse_input_is_read_whole_into_memory_by_record_count_past_every_limit(tmp_path):
    """A 3 GiB sparse CSV costs its author nothing (a shared inbox, `truncate -s`): a header, one row, then zero
    bytes with no newline. `check()` passes (a field longer than the sniff), and `screen` calls `record_count()`
    on every file before any work, outside any handler: `_count_lines` iterates the raw file by lines, so the
    whole 3 GiB "line" is held at once, whatever RESIDENT_POOL_MAX_INPUT_BYTES says (1 MB here). Under a 2 GiB
    address-space limit it is a MemoryError (unbounded, it takes the host's memory), which ends the whole flow
    run: no other file of the inbox is screened. Expected: counting reads in bounded blocks, stops at the
    operator's byte limit, and the file is refused by that limit alone."""
    big = tmp_path / "big.csv"
    big.write_bytes(b"sequence\nMKV\n")
    os.truncate(big, 3 * 2**30)
    done = subprocess.run([sys.executable, "-c", COUNT, str(big)], capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


# -- issue 24: one bad value fails one record -----------------------------------------------------------------------


def _texts(n: int) -> list[str]:
    letters = "ACDEFGHIKLMNPQRSTVY"  # no W: the hostile worker answers differently for inputs holding one
    return [f"MKV{letters[i % 19]}{letters[(i // 19) % 19]}" for i in range(n)]


def _hostile(pool_dir: Path, slug: str) -> None:
    write_provider(pool_dir, slug, "[lifecycle]\nmax_replicas = 1\n", worker=Path(__file__).parent / "workers" / "hostile_items.py")


@pytest.mark.usefixtures("prefect_harness")
def test_review_a_nan_in_an_answer_is_written_into_the_jsonl_output_as_NaN(pool_dir, tmp_path):
    """A model's NaN (an fp16 overflow) in an array field of one item: the campaign writes it with Python's
    default encoder, `NaN`, which is no JSON (jq, JSON.parse and every strict reader reject the line; the
    store keeps it too). docs/security.md: "an answer the writer cannot write (... a value JSON cannot hold
    ...) fails that input's record with its reason ... and is not stored". Expected: that input's record is
    ok: false (bad_answer), every line of the output is JSON."""
    from screen import screen

    _hostile(pool_dir, "nans")
    texts = _texts(6)
    texts[2] = "MKVWA"
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"s{n}", "sequence": t}) + "\n" for n, t in enumerate(texts)))
    output = tmp_path / "out.jsonl"
    state = screen(input=str(inputs), provider="nans", chunk_size=3, output=str(output), encoding="array",
                   report=False, return_state=True)
    lines = output.read_text().splitlines()

    def strict(line):
        return json.loads(line, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(f"{name} is no JSON")))

    unreadable = []
    for line in lines:
        try:
            strict(line)
        except ValueError as exc:
            unreadable.append(f"{exc}: {line}")
    assert not unreadable, (state.message, unreadable)
    assert json.loads(lines[2])["ok"] is False and json.loads(lines[2])["reason"] == "bad_answer"


@pytest.mark.usefixtures("prefect_harness")
def test_review_a_parquet_embedding_of_another_size_is_written_ok_with_no_embedding(pool_dir, tmp_path):
    """Parquet's embedding column is a fixed-size list sized from the first answer (4 floats). One input's
    answer holds 3: the writer puts a null there and keeps the row ok = true, so an answer the output cannot
    hold is silently dropped, and stays in the store as good. Expected: that row is ok = false, reason
    bad_answer, like every other value the Parquet writer cannot take (`_parquet_batch`)."""
    import pyarrow.parquet as pq
    from screen import screen

    _hostile(pool_dir, "sizes")
    texts = _texts(6)
    texts[4] = "MKVWC"
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"s{n}", "sequence": t}) + "\n" for n, t in enumerate(texts)))
    output = tmp_path / "out.parquet"
    state = screen(input=str(inputs), provider="sizes", chunk_size=3, output=str(output), format="parquet",
                   report=False, return_state=True)
    rows = pq.read_table(output).to_pylist()
    assert len(rows) == 6, state.message
    assert all(row["embedding"] is not None for row in rows if row["ok"]), rows
    assert rows[4]["ok"] is False and rows[4]["reason"] == "bad_answer", rows[4]


# -- issue 23: a kit laid out for the original launcher --------------------------------------------------------------


@pytest.fixture
def kit_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("MODEL_OPT", "MODEL_OPT_JIT_ROOT", "MODEL_OPT_LEVERS_OFF"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_review_a_kit_whose_resolve_answers_a_read_only_mapping_gets_its_row_read(tmp_path, kit_home):
    """The original probe's `_row_of` tries `getattr(resolution, "env")`, then `resolution["env"]`: any mapping
    answers. kit_probe.py's `_vars` subscripts only a `dict` (else getattr), so a kit whose resolve() hands out a
    `types.MappingProxyType` (or a UserDict, or any Mapping) exports "an empty environment row" and the
    provider is refused. Expected: the row the original launcher reads, {"PROXIED_OPT_ROUTE": "triton"}."""
    from resident_pool.kit import ask_kit

    python = make_kit_venv(tmp_path / "venv", "proxied_opt", kits_dir=KITS)
    answer = ask_kit(python, "proxied_opt", "fast")
    assert answer["env"] == {"PROXIED_OPT_ROUTE": "triton"}, answer


def test_review_a_kit_whose_resolve_answers_a_read_only_mapping_serves_under_the_pool(pool_dir, tmp_path,
                                                                                       kit_home):
    from resident_pool import Pool

    python = make_kit_venv(tmp_path / "venv", "proxied_opt", kits_dir=KITS)
    write_provider(pool_dir, "proxied", f'[env]\npython = "{python}"\n[kit]\npackage = "proxied_opt"\n',
                   worker=ROOT / "tests" / "original" / "worker.py")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("proxied", {"sequence": "MKVLA", "report": True})
        pool.stop("proxied")
    assert answer["report"]["env"]["MODEL_OPT"], answer


def test_review_the_originals_kit_env_takes_a_number_as_its_text(tmp_path):
    """The original launcher applies `[kit] env` with `env[str(key)] = str(value)`: `POST_RELEASE_NTOK = 0` is
    "0". Here `Kit.env` is dict[str, str] under a strict model, so a manifest the original ran is a
    ManifestError ("Input should be a valid string"). Expected: loaded, the value "0"."""
    from resident_pool.manifest import load_manifest

    folder = tmp_path / "manifests" / "numbered"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "original" / "worker.py", folder / "worker.py")
    (folder / "manifest.toml").write_text('slug = "numbered"\nworker = "worker.py"\n[kit]\npackage = "proxied_opt"\n'
                                          "[kit.env]\nPROXIED_OPT_POST_RELEASE_NTOK = 0\nPROXIED_OPT_CAP = 1.5\n")
    manifest = load_manifest(folder / "manifest.toml")
    assert manifest.kit.env == {"PROXIED_OPT_POST_RELEASE_NTOK": "0", "PROXIED_OPT_CAP": "1.5"}


# -- issue 23: the model side ---------------------------------------------------------------------------------------


def test_review_a_worker_that_loads_the_base_under_a_dotted_name_starts_under_the_pool(pool_dir):
    """The original's worker_base finds its protocol by path whatever name it was loaded under. Here `protocol()`
    (and `load_arrays()`) take `__package__` as "imported as part of resident_pool": a worker that loads the
    base as `tooluniverse.remote_resident.worker_base` (its name in the original's package) makes `__package__`
    "tooluniverse.remote_resident", and `from . import protocol` raises ModuleNotFoundError: the worker exits 1
    before it binds. Expected: it serves."""
    from resident_pool import Pool

    write_provider(pool_dir, "dotted", "", worker=HERE / "dotted_worker.py")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("dotted", {"sequence": "MKVLA"})
        pool.stop("dotted")
    assert answer == {"reversed": "ALVKM", "ping_op": "ping", "arrays": True}  # arrays.py found by path too


def test_review_protocol_recv_line_ends_a_stream_with_protocol_error_as_the_original(tmp_path):
    """A worker with its own loop over `protocol()`, shaped as the original's serve(): it leaves a connection when
    `recv_line` raises ProtocolError, the original's only way out (its serve() calls recv_line again and again
    and has no other exit). This project's `recv_line` returns None at the end of a stream instead, so the
    loop's `req.get("op")` raises AttributeError and the worker dies when its first client hangs up. Expected:
    a second client is answered."""
    socket_path = str(tmp_path / "raw.sock")
    env = {**os.environ, "TOOLUNIVERSE_REMOTE_WORKER_BASE": WORKER_BASE_PATH,
           "TOOLUNIVERSE_REMOTE_PROTOCOL": PROTOCOL_PATH}
    worker = subprocess.Popen(["/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable,
                               str(HERE / "raw_loop_worker.py"), socket_path], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_listening(socket_path, worker)  # its own loop binds, then listens: the file comes first
        answers = []
        # One client after another, each hanging up after its answer: a worker that died at a hang-up answers
        # no later client (it reads one connection to its end before it accepts the next).
        for _ in range(3):
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(5)
                    conn.connect(socket_path)
                    conn.sendall(b'{"op": "ping"}\n')
                    answers.append(json.loads(conn.makefile().readline()))
            except (OSError, ValueError) as exc:
                answers.append(repr(exc))
        alive = worker.poll() is None
    finally:
        if worker.poll() is None:
            worker.kill()
        said = worker.communicate(timeout=30)[0]
    assert alive and answers == [{"ok": True, "op": "ping"}] * 3, (answers, said[-1500:])


# -- issue 23: a caller written to the original supervisor -----------------------------------------------------------


# -- issue 24: a worker's attachment costs nothing; writing it costs the campaign 12 times its size ------------------

AMPLIFY = textwrap.dedent("""
    import mmap, os, resource
    import numpy
    from resident_pool.campaigns.campaign import _written, DEFAULT_MAX_RESULT_BYTES
    fd = os.memfd_create("answer")
    os.ftruncate(fd, 40_000_000)  # sparse: the worker paid nothing for it
    values = numpy.frombuffer(mmap.mmap(fd, 40_000_000, prot=mmap.PROT_READ), dtype=numpy.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text, problem = _written({"embedding": values}, DEFAULT_MAX_RESULT_BYTES)
    rise_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"{rise_mb:.0f} {len(text)} {problem}")
""")


def test_review_the_issues_own_40_mb_sparse_answer_still_costs_the_campaign_460_mb():
    """Issue 24 finding 5 as filed: a worker's 40 MB sparse attachment raised the campaign's peak by 463 MB. The
    fix added a 64 MiB per-result limit measured on the decoded arrays (nbytes), so this 40 MB answer is under
    it, and `_written` still turns the array into a Python list and JSON text: +462 MB here, as before (a
    64 MiB answer: about 800 MB). The operator's number bounds the attachment, not the memory it costs.
    Expected: an answer under the limit costs about its own size to write (here: at most 4 times)."""
    done = subprocess.run([sys.executable, "-c", AMPLIFY], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rise_mb, written, _ = done.stdout.split()
    assert float(rise_mb) <= 160, f"writing a 40 MB answer raised the peak by {rise_mb} MB ({written} bytes written)"
