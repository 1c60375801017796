"""The screening campaign end to end: flows/screen.py on Prefect's test harness, a real pool, a fast provider.

The provider (tests/workers/embedder.py) logs how many inputs each request
computed to $EMBEDDER_COUNT, so "computes only what is new" is counted at the model.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import os
import re
import signal
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import settled_task_runs, wait_until
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from providers import EMBEDDER_ENV, write_provider

from resident_pool import Pool
from resident_pool.errors import CampaignFailed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "flows"))

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture
def embedder(pool_dir, tmp_path, monkeypatch):
    """The fast provider, counting what it computes; returns a function that reads the count."""
    count = tmp_path / "computed.log"
    monkeypatch.setenv("EMBEDDER_COUNT", str(count))
    write_provider(pool_dir, "embedder", EMBEDDER_ENV + "[lifecycle]\nmax_replicas = 1\n", worker="embedder.py")

    def computed() -> int:
        return sum(int(line) for line in count.read_text().split()) if count.exists() else 0

    return computed


def _screen(pool_dir, **parameters):
    from screen import screen

    parameters.setdefault("provider", "embedder")
    return screen(**parameters)


def _state(pool_dir, **parameters):
    from screen import screen

    parameters.setdefault("provider", "embedder")
    return screen(return_state=True, **parameters)


def _mapped(page: str) -> int:
    """How many answers a report's map draws: a dot each, or one dot for those alike (the test embedder's answers
    coincide for texts of one length and letter sum), its label counting them."""
    return len(re.findall(r"<title>s\d+</title>", page)) + sum(
        int(count) for count in re.findall(r"<title>(\d+) answers alike", page))


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"s{n}", "sequence": text}) + "\n" for n, text in enumerate(texts)))
    return path


def _texts(n: int, salt: str = "") -> list[str]:
    """``n`` distinct protein-like texts (letters only, so they are valid FASTA too)."""
    letters = "ACDEFGHIKLMNPQRSTVWY"
    return [f"MKV{salt}" + "".join(letters[(i // 20**p) % 20] for p in range(5)) for i in range(n)]


def _task_runs(state):
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))


def _artifacts(state):
    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))


def test_a_rerun_a_reordered_file_and_ten_appended_sequences_compute_0_0_and_10(pool_dir, embedder, tmp_path):
    texts = _texts(300)
    output = tmp_path / "out.jsonl"
    first = _screen(pool_dir, input=str(_jsonl(tmp_path / "a.jsonl", texts)), chunk_size=64, output=str(output))
    assert first["computed"] == embedder() == 300 and first["ok"] == 300
    again = _screen(pool_dir, input=str(tmp_path / "a.jsonl"), chunk_size=64, output=str(output))
    assert again["computed"] == 0 and again["from_store"] == 300 and embedder() == 300
    shuffled = texts[150:] + texts[:150]
    reordered = _screen(pool_dir, input=str(_jsonl(tmp_path / "b.jsonl", shuffled)), chunk_size=64,
                        output=str(tmp_path / "b.out.jsonl"))
    assert reordered["computed"] == 0 and embedder() == 300
    grown = _screen(pool_dir, input=str(_jsonl(tmp_path / "c.jsonl", texts + _texts(10, salt="NEW"))), chunk_size=64,
                    output=str(tmp_path / "c.out.jsonl"))
    assert grown["computed"] == 10 and embedder() == 310
    records = _records(tmp_path / "c.out.jsonl")
    assert [r["index"] for r in records] == list(range(310)) and all(r["ok"] for r in records)
    # The same text answers the same wherever it sits in the file.
    by_text = {t: r["embedding"] for t, r in zip(texts + _texts(10, salt="NEW"), records, strict=True)}
    for text, record in zip(shuffled, _records(tmp_path / "b.out.jsonl"), strict=True):
        assert record["embedding"] == by_text[text]


def test_duplicates_inside_one_file_are_computed_once_and_each_gets_its_record(pool_dir, embedder, tmp_path):
    texts = _texts(40) * 5 + _texts(40)[:7]
    summary = _screen(pool_dir, input=str(_jsonl(tmp_path / "dups.jsonl", texts)), chunk_size=16,
                      output=str(tmp_path / "out.jsonl"))
    assert embedder() == 40 and summary["computed"] == 40
    assert summary["duplicates"] + summary["from_store"] == len(texts) - 40
    records = _records(tmp_path / "out.jsonl")
    assert len(records) == len(texts) and all(r["ok"] for r in records)
    assert records[0]["embedding"] == records[40]["embedding"] == records[200]["embedding"]


def test_bad_records_fail_alone_naming_file_and_line(pool_dir, embedder, tmp_path):
    fasta = tmp_path / "mixed.fasta"
    fasta.write_bytes(b">good1 first\nMKVLA\nAGG\n"
                      b">bad\xff\xfeheader\nMKV\n"
                      b">huge\n" + b"A" * (1024 * 1024 + 10) + b"\n"
                      b">binary\nMK\x00\x01V\n"
                      b">empty\n"
                      b">good2\nmkv\n")
    summary = _screen(pool_dir, input=str(fasta), output=str(tmp_path / "fasta.out.jsonl"))
    records = _records(tmp_path / "fasta.out.jsonl")
    assert [r["ok"] for r in records] == [True, False, False, False, False, True]
    assert records[0]["id"] == "good1" and records[0]["tokens"] == 8 and records[5]["tokens"] == 3
    for record, line, words in ((records[1], 4, "not UTF-8"), (records[2], 6, "byte limit"),
                                (records[3], 8, "not a sequence letter"), (records[4], 10, "empty sequence")):
        assert record["reason"] == "bad_input"
        assert record["error"].startswith(f"{fasta}:{line}: ") and words in record["error"]
    assert summary["ok"] == 2 and summary["failure_reasons"] == {"bad_input": 4}

    table = tmp_path / "mixed.csv"
    table.write_bytes(b"ID,Sequence\nbig," + b"M" * 200_000 + b"\nhuge," + b"M" * (2 * 1024 * 1024) +
                      b"\nlatin1,caf\xe9\nfine,MKV\n")
    _screen(pool_dir, input=str(table), output=str(tmp_path / "csv.out.jsonl"))
    records = _records(tmp_path / "csv.out.jsonl")
    assert [r["ok"] for r in records] == [True, False, False, True]  # 200 kB is a record, 2 MiB is not
    assert "record limit" in records[1]["error"] and f"{table}:3:" in records[1]["error"]
    assert "not UTF-8" in records[2]["error"] and f"{table}:4:" in records[2]["error"]

    lines = tmp_path / "mixed.jsonl"
    lines.write_text(json.dumps({"id": "a", "sequence": "MKV"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"
                     + json.dumps({"id": "c", "text": "MKVL"}) + "\n" + json.dumps({"id": "d", "sequence": 5}) + "\n")
    _screen(pool_dir, input=str(lines), output=str(tmp_path / "jsonl.out.jsonl"))
    records = _records(tmp_path / "jsonl.out.jsonl")
    assert [r["ok"] for r in records] == [True, False, True, False]
    assert "nested too deeply" in records[1]["error"] and records[1]["error"].startswith(f"{lines}:2:")


def test_one_input_rule_in_the_predict_flow_the_screen_flow_and_the_cli_each_bad_input_fails_alone(pool_dir, tmp_path):
    """Issue 33: the predict flow took digits that screen refused (as "line 1202 holds b'1'"), both took '*', and
    one blank item failed a whole predict run without naming it. A provider declares what it takes ([inputs]:
    here proteins, by the default policy); every entry point applies that rule, a bad input fails alone, named
    by its position (and id), and the others are answered."""
    write_provider(pool_dir, "proteins", EMBEDDER_ENV + '[inputs]\nkinds = ["protein"]\n', worker="embedder.py")
    from predict import predict

    state = predict(provider="proteins", sequences=["MKV", "MK1V", " ", "MK*V", "mka*"], return_state=True)
    assert state.is_completed() and state.name == "Completed with failures", state
    assert state.message.startswith("2 answered, 3 refused: input 2 of 5: position 3 holds '1'"), state.message
    items = state.result()["items"]
    assert [item.get("ok", True) for item in items] == [True, False, False, False, True]
    assert items[4]["input"] == "MKA" and items[4]["tokens"] == 3  # mka* as sent: the final stop dropped
    assert items[2] == {"input": " ", "ok": False, "reason": "bad_input",
                        "error": "input 3 of 5: empty: it holds no residue letters"}
    assert items[3]["error"].startswith("input 4 of 5: position 3 is a stop (*) before the end")

    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKV\n>digit\nMK1V\n>star\nMK*V\n>gap\nMK-V\n>sec\nMKUV\n>stop\nmka*\n")
    summary = _screen(pool_dir, provider="proteins", input=str(fasta), output=str(tmp_path / "out.jsonl"))
    records = _records(tmp_path / "out.jsonl")
    assert [r["ok"] for r in records] == [True, False, False, False, False, True] and summary["ok"] == 2
    assert records[5]["tokens"] == 3
    assert records[1]["error"] == f"{fasta}:3: line 4 holds '1', which is not a sequence letter"
    assert records[2]["error"].startswith(f"{fasta}:5: star: position 3 is a stop (*) before the end")
    assert records[3]["error"].startswith(f"{fasta}:7: gap: position 3 is a gap (-)")
    assert records[4]["error"].startswith(f"{fasta}:9: sec: position 3 is U, selenocysteine, which this provider "
                                          "refuses")

    done = subprocess.run([sys.executable, "-m", "resident_pool", "predict", "proteins", "--payload",
                           json.dumps({"inputs": ["MKV", "MK1V", "mk v"]})], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    answered = json.loads(done.stdout)["items"]
    assert answered[0]["tokens"] == 3 and answered[2]["tokens"] == 3
    assert answered[1]["ok"] is False and answered[1]["error"].startswith("input 2 of 3: position 3 holds '1'")
    assert "proteins: input 2 of 3: position 3 holds '1', which is not a residue letter" in done.stderr


def test_a_binary_file_named_fasta_gets_one_clear_error_and_no_task_runs(pool_dir, embedder, tmp_path):
    binary = tmp_path / "proteins.fasta"
    binary.write_bytes(bytes(range(256)) * 1024)
    done = subprocess.run([sys.executable, str(ROOT / "flows" / "screen.py"), "--input", str(binary),
                           "--provider", "embedder", "--manifests", str(pool_dir)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert str(binary) in line and "not a FASTA input file" in line and "expected FASTA" in line
    state = _state(pool_dir, input=str(binary), output=str(tmp_path / "out.jsonl"))
    assert state.is_failed() and str(binary) in state.message and "first 64 KiB" in state.message
    assert _task_runs(state) == [] and embedder() == 0


def test_a_gzipped_fasta_a_tsv_with_a_sequence_column_and_a_slug_with_an_underscore(pool_dir, embedder, tmp_path):
    write_provider(pool_dir, "esm_2", "", worker="embedder.py")
    fasta = tmp_path / "seqs.fa.gz"
    with gzip.open(fasta, "wt") as out:
        out.write("".join(f">p{n} protein {n}\n{text[:4]}\n{text[4:]}\n" for n, text in enumerate(_texts(30))))
    state = _state(pool_dir, input=str(fasta), provider="esm_2", chunk_size=8, output=str(tmp_path / "gz.jsonl"))
    assert state.is_completed(), state.message
    records = _records(tmp_path / "gz.jsonl")
    assert [r["id"] for r in records] == [f"p{n}" for n in range(30)] and all(r["ok"] for r in records)
    keys = {artifact.key for artifact in _artifacts(state)}
    from resident_pool.prefect import artifact_key

    assert {artifact_key("screen-progress", "esm_2"), artifact_key("screen-summary", "esm_2")} <= keys
    assert all(key.startswith(("screen-progress-esm-2-", "screen-summary-esm-2-", "screen-output-esm-2-"))
               for key in keys if key and "esm" in key)

    tsv = tmp_path / "uniprot.tsv"
    tsv.write_text("Entry\tProtein names\tSequence\n" + "".join(f"Q{n}\tprotein {n}\t{text}\n"
                                                                for n, text in enumerate(_texts(12))))
    _screen(pool_dir, input=str(tsv), provider="esm_2", id_column="entry", output=str(tmp_path / "tsv.jsonl"))
    records = _records(tmp_path / "tsv.jsonl")
    assert [r["id"] for r in records] == [f"Q{n}" for n in range(12)] and all(r["ok"] for r in records)
    assert records[3]["tokens"] == len(_texts(12)[3])

    named = tmp_path / "named.csv"
    named.write_text("accession,aa\nX1,MKV\n")
    _screen(pool_dir, input=str(named), provider="esm_2", column="AA", output=str(tmp_path / "named.jsonl"))
    assert _records(tmp_path / "named.jsonl")[0]["tokens"] == 3
    wrong = _state(pool_dir, input=str(named), provider="esm_2", output=str(tmp_path / "wrong.jsonl"))
    assert wrong.is_failed() and "no column named 'sequence'" in wrong.message and "--column" in wrong.message


def test_chunk_runs_are_named_by_their_inputs_and_nothing_is_persisted_by_prefect(pool_dir, embedder, tmp_path):
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    storage = tmp_path / "prefect-results"
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: storage}):
        state = _state(pool_dir, input=str(_jsonl(tmp_path / "in.jsonl", _texts(100))), chunk_size=32,
                       output=str(tmp_path / "out.jsonl"))
    assert state.is_completed() and state.message == "100 ok, 0 failed"
    runs = settled_task_runs(state, 4)
    assert sorted(run.name for run in runs) == sorted(
        ["predict-chunk[0-31]", "predict-chunk[32-63]", "predict-chunk[64-95]", "predict-chunk[96-99]"])
    # One replica: at most two chunk runs at once (one computing, the next holding its place in line).
    spans = sorted((run.start_time, run.end_time) for run in runs)
    most = max(sum(1 for start, end in spans if start <= at < end) for at, _ in spans)
    assert most <= 2
    assert not storage.exists() or not any(storage.iterdir())


def _logs(state):
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[state.state_details.flow_run_id])), limit=200)
    return sorted(logs, key=lambda log: log.timestamp)


def _log_lines(state, level=0, containing=""):
    """The run's log lines at ``level`` or above holding ``containing``, once one has reached the API (logs are
    sent in batches, after the run may have ended)."""
    return wait_until(lambda: [log.message for log in _logs(state) if log.level >= level and containing in log.message],
                      timeout=30, interval=0.5, message=f"a log line holding {containing!r}")


def test_a_chunk_is_named_by_the_inputs_it_holds_when_repeats_and_bad_ones_are_left_out(pool_dir, embedder, tmp_path):
    """The report: a chunk named [0-2] held 2 inputs. Input 1 is bad and 3 repeats 0: the chunk holds 0, 2 and 4."""
    texts = _texts(3)
    state = _state(pool_dir, input=str(_jsonl(tmp_path / "in.jsonl", [texts[0], "", texts[1], texts[0], texts[2]])),
                   output=str(tmp_path / "out.jsonl"))
    assert state.message.startswith("4 ok, 1 failed; failed inputs: ")
    assert [run.name for run in settled_task_runs(state, 1)] == ["predict-chunk[0,2,4]"]
    from resident_pool.campaigns.campaign import Chunk

    assert Chunk(indexes=list(range(0, 200, 3)), keys=[b""] * 67).label == "0-198, 67 inputs"
    assert Chunk(indexes=[5, 6, 7], keys=[b""] * 3).label == "5-7" and Chunk(indexes=[9], keys=[b""]).label == "9"


def test_a_screens_progress_only_rises_and_ends_at_100_with_every_update_sent_at_once(pool_dir, embedder, tmp_path,
                                                                                      monkeypatch):
    """The report: a 2,000-input run's progress read 18.75, 62.5, 0, 0, 0, 0, 100. Every update is sent here
    (PROGRESS_EVERY_S and LOG_EVERY_S at 0), so each value the artifact took is seen, and each log line."""
    import screen

    sent = []
    real = screen.update_progress_artifact

    def recorded(artifact_id, progress, *args, **kwargs):
        sent.append(progress)
        return real(artifact_id, progress, *args, **kwargs)

    monkeypatch.setattr(screen, "update_progress_artifact", recorded)
    monkeypatch.setattr(screen, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(screen, "LOG_EVERY_S", 0.0, raising=False)
    monkeypatch.setenv("EMBEDDER_DELAY_S", "0.02")
    inputs = tmp_path / "in.fasta"
    inputs.write_text("".join(f">s{n}\n{text}\n" for n, text in enumerate(_texts(2000))))
    state = _state(pool_dir, input=str(inputs), chunk_size=50, output=str(tmp_path / "out.jsonl"))
    assert state.message == "2000 ok, 0 failed"
    assert sent == sorted(sent) and sent[-1] == 100, sent  # monotone, ends at 100
    assert len({round(value) for value in sent if 0 < value < 100}) >= 10, sent  # and says where it is between
    assert all(value < 100 for value in sent[:-3])  # 100 only at the end
    lines = _log_lines(state, containing="2,000 of 2,000 inputs done (100.0%)") and _log_lines(state,
                                                                                               containing="inputs done")
    assert any(" of 2,000 inputs done (" in line and "inputs/s" in line and "ETA" in line for line in lines), lines
    assert any(line.startswith("2,000 of 2,000 inputs done (100.0%)") for line in lines), lines


def test_failed_inputs_are_a_table_and_a_warning_and_the_summary_names_their_reasons(pool_dir, embedder, tmp_path):
    """Issue 33: a run with failed inputs ends Completed and says so by its state's name, its message leads to the
    failed inputs; the artifacts keep long text (errors, paths) under a short table, where the UI cuts nothing."""
    texts = _texts(8)
    inputs = _jsonl(tmp_path / "in.jsonl", [texts[0], "", texts[1], "RAISE | *this* ~x~", *texts[2:]])
    state = _state(pool_dir, input=str(inputs), output=str(tmp_path / "out.jsonl"))
    assert state.is_completed() and state.name == "Completed with failures", state
    artifacts = {a.key: a for a in _artifacts(state)}
    failed = artifacts["screen-failed-embedder"]
    ui = os.environ["PREFECT_API_URL"].removesuffix("/api")
    assert state.message == f"8 ok, 2 failed; failed inputs: {ui}/artifacts/artifact/{failed.id}", state.message
    table, _, why = failed.data.partition("### Why each failed")
    assert "| 1 | s1 | bad_input |" in table and "| 3 | s3 | request_failed |" in table
    assert table.strip().splitlines()[-2:] == ["| 1 | s1 | bad_input |", "| 3 | s3 | request_failed |"]  # no long column
    (bad, refused) = [line for line in why.splitlines() if line.startswith("- ")]
    assert bad.startswith("- **1** (s1, bad_input): ") and f"{inputs}:2: no non-empty string field" in bad
    assert refused.startswith("- **3** (s3, request_failed): ") and "input contains RAISE" in refused
    summary = artifacts["screen-summary-embedder"].data
    assert "| in.jsonl | 10 | 8 | 2 | 9 | 0 | 0 |" in summary  # the bad input is never computed
    assert "- failure reasons: bad_input: 1, request_failed: 1" in summary  # not {}
    assert f"- output: {tmp_path / 'out.jsonl'}" in summary
    (warning,) = _log_lines(state, level=30)
    assert "2 of 10 input(s) failed (bad_input: 1, request_failed: 1)" in warning
    assert str(tmp_path / "out.jsonl") in warning


def test_an_empty_inbox_ends_with_a_warning_and_says_so(pool_dir, embedder, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "notes.txt").write_text("not an input\n")
    state = _state(pool_dir, input=str(inbox))
    assert state.is_completed() and state.message == f"no input files in {inbox}"
    (warning,) = _log_lines(state, level=30)
    assert "no input files to screen" in warning and ".fasta" in warning
    assert embedder() == 0


def test_the_outputs_artifact_is_keyed_and_names_path_host_and_counts_not_a_file_url(pool_dir, embedder, tmp_path):
    import socket

    state = _state(pool_dir, input=str(_jsonl(tmp_path / "in.jsonl", [*_texts(9), ""])),
                   output=str(tmp_path / "out.jsonl"))
    artifacts = {a.key: a for a in _artifacts(state)}
    text = artifacts["screen-output-embedder"].data
    assert str(tmp_path / "out.jsonl") in text and socket.gethostname() in text
    shown = text.replace("\\", "")
    assert f"- {tmp_path / 'in.jsonl'}: 10 records, 9 ok, 1 failed\n    - output: {tmp_path / 'out.jsonl'}" in shown
    assert (tmp_path / "out.jsonl").as_uri() + ")" not in text  # the output is named by path and host, not a URL
    assert not [a for a in _artifacts(state) if a.type == "markdown" and not a.key]  # every artifact is keyed


def test_the_outputs_artifact_names_a_relative_output_and_its_report_by_path_never_as_a_url():
    """`make run` passes `--output out/uniprot-500.fasta.minilm.jsonl`: Path.as_uri() raised on the relative
    report path, and the flow failed after writing every output. The report is a path on the host, as the output is."""
    from screen import _outputs

    total = {"provider": "minilm", "host": "vm", "files": [
        {"file": "data/uniprot-500.fasta", "output": "out/uniprot-500.fasta.minilm.jsonl", "inputs": 500, "ok": 500,
         "failed": 0, "report": "out/uniprot-500.fasta.minilm.jsonl.report.html"}]}
    text = _outputs(total)
    assert "uniprot-500.fasta.minilm.jsonl.report.html" in text and "file:" not in text and "](" not in text


def test_screen_py_with_an_output_relative_to_its_folder_completes_and_names_it_whole(pool_dir, tmp_path):
    """The command `make run` runs, with a fast provider and an output relative to the working folder."""
    from prefect.settings import PREFECT_API_URL

    write_provider(pool_dir, "embedder", EMBEDDER_ENV, worker="embedder.py")
    inputs = tmp_path / "in.fasta"
    inputs.write_text("".join(f">s{n}\nMKV{text}\n" for n, text in enumerate(_texts(20))))
    done = subprocess.run([sys.executable, str(ROOT / "flows" / "screen.py"), "--input", str(inputs), "--provider",
                           "embedder", "--manifests", str(pool_dir), "--output", "out/in.embedder.jsonl"],
                          cwd=tmp_path, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    output = tmp_path / "out" / "in.embedder.jsonl"
    assert len(_records(output)) == 20
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["output"] == str(output) and summary["report"] == f"{output}.report.html"


def test_a_screen_whose_provider_never_starts_ends_failed_naming_why_and_screen_py_exits_1(pool_dir, tmp_path):
    """Every input failed because the model never started (start_failed, then breaker_open): that is not a batch
    of bad inputs, yet the run ended Completed('0 ok, 200 failed') and flows/screen.py exited 0, so a nightly
    screen of a broken model was green in the UI and in cron."""
    from prefect.settings import PREFECT_API_URL

    write_provider(pool_dir, "refuses", 'worker_args = ["{socket}", "--exit-before-bind", "3"]\n')
    inputs = tmp_path / "in.fasta"
    inputs.write_text("".join(f">s{n}\nMKV{text}\n" for n, text in enumerate(_texts(200))))
    done = subprocess.run([sys.executable, str(ROOT / "flows" / "screen.py"), "--input", str(inputs), "--provider",
                           "refuses", "--manifests", str(pool_dir), "--output", str(tmp_path / "out.jsonl")],
                          env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                          capture_output=True, text=True, timeout=300, check=False)
    assert '"ok": 0' in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.returncode == 1, "0 ok of 200, the provider never started, and the command exited 0"
    said = done.stderr[done.stderr.index("error: "):]
    assert "0 ok, 200 failed: refuses never started: " in said and "exit code 3" in said, said
    assert len(_records(tmp_path / "out.jsonl")) == 200  # every input still has its record, with its reason


def test_a_run_whose_inputs_are_all_bad_still_completes_with_a_warning(pool_dir, embedder, tmp_path):
    state = _state(pool_dir, input=str(_jsonl(tmp_path / "in.jsonl", ["RAISE", "", "RAISE"])))
    assert state.is_completed() and state.message.startswith("0 ok, 3 failed; failed inputs: "), state.message
    (warning,) = _log_lines(state, level=30)
    assert "3 of 3 input(s) failed (request_failed: 2, bad_input: 1)" in warning, warning


def test_the_report_beside_the_output_charts_the_run_and_maps_the_vectors_offline(pool_dir, embedder, tmp_path):
    state = _state(pool_dir, input=str(_jsonl(tmp_path / "in.jsonl", [*_texts(300), "", "RAISE"])),
                   output=str(tmp_path / "out.jsonl"), chunk_size=16)
    report = tmp_path / "out.jsonl.report.html"
    page = report.read_text()
    assert state.result()["report"] == str(report)
    for chart in ("inputs done", "throughput", "failed inputs"):
        assert f'data-chart="{chart}"' in page
    assert page.count("<polyline") == 3 and _mapped(page) == 300  # every vector: fewer than the sample
    assert "http://" not in page and "https://" not in page and " src=" not in page and "<script" not in page
    assert "request_failed" in page and "bad_input" in page and "s301" in page  # the failed inputs, by id
    summary = next(a for a in _artifacts(state) if a.key == "screen-summary-embedder").data
    assert f"- report: {report}" in summary.replace("\\", "")


def test_a_rerun_written_again_from_the_store_whole_still_maps_every_vector(pool_dir, embedder, tmp_path):
    """A FASTA file screened before is written again from its stored stretches (no record parsed): the report's
    map must still see those records' vectors, not an empty sample."""
    inputs = _fasta(tmp_path / "in.fasta", _texts(300))
    _screen(pool_dir, input=str(inputs), output=str(tmp_path / "first.jsonl"))
    again = _screen(pool_dir, input=str(inputs), output=str(tmp_path / "again.jsonl"))
    assert again["computed"] == 0 and again["ok"] == 300
    page = (tmp_path / "again.jsonl.report.html").read_text()
    assert _mapped(page) == 300 and re.search(r"<title>(s0|\d+ answers alike: s0,)", page)  # every vector, by id


def test_fail_on_input_errors_fails_the_run_and_the_cli_exits_1(pool_dir, embedder, tmp_path):
    inputs = _jsonl(tmp_path / "in.jsonl", [*_texts(9), ""])
    default = _state(pool_dir, input=str(inputs), output=str(tmp_path / "a.jsonl"))
    assert default.is_completed() and default.message.startswith("9 ok, 1 failed; failed inputs: ")
    strict = _state(pool_dir, input=str(inputs), output=str(tmp_path / "b.jsonl"), fail_on_input_errors=True)
    assert strict.is_failed() and strict.message.startswith("9 ok, 1 failed")
    with pytest.raises(CampaignFailed) as raised:
        _screen(pool_dir, input=str(inputs), output=str(tmp_path / "c.jsonl"), fail_on_input_errors=True)
    assert raised.value.details["summary"]["failed"] == 1
    assert len(_records(tmp_path / "b.jsonl")) == 10  # every input still has its record

    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    command = [sys.executable, str(ROOT / "flows" / "screen.py"), "--input", str(inputs), "--provider", "embedder",
               "--manifests", str(pool_dir), "--output", str(tmp_path / "cli.jsonl")]
    assert subprocess.run(command, env=env, capture_output=True, timeout=180, check=False).returncode == 0
    done = subprocess.run([*command, "--fail-on-input-errors"], env=env, capture_output=True, text=True, timeout=180,
                          check=False)
    assert done.returncode == 1 and "9 ok, 1 failed" in done.stderr


KILLABLE = """
import sys
sys.path.insert(0, sys.argv[1])
from screen import screen
screen(input=sys.argv[2], provider="embedder", chunk_size=50, output=sys.argv[3])  # providers: the environment's
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_campaign_killed_at_half_computes_only_the_rest_when_run_again(pool_dir, embedder, tmp_path, monkeypatch,
                                                                         isolated_dirs):
    from prefect.settings import PREFECT_API_URL

    monkeypatch.setenv("EMBEDDER_DELAY_S", "0.1")  # a campaign slow enough (about 4 s) to be killed halfway
    texts = _texts(2000)
    inputs = _jsonl(tmp_path / "in.jsonl", texts)
    output = tmp_path / "out.jsonl"
    store = Path(isolated_dirs["results"]) / "embedder.sqlite3"

    def stored() -> int:
        if not store.exists():
            return 0
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
        try:
            return db.execute("SELECT count(*) FROM results").fetchone()[0]
        except sqlite3.OperationalError:  # created, its table not yet
            return 0
        finally:
            db.close()

    def requests() -> list[int]:
        return [int(line) for line in (tmp_path / "computed.log").read_text().split()]

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    flow_run = subprocess.Popen([sys.executable, "-c", KILLABLE, str(ROOT / "flows"), str(inputs), str(output),
                                 str(pool_dir)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: stored() >= 1000, timeout=240, interval=0.05, message="half the campaign in the store")
    finally:
        os.kill(flow_run.pid, signal.SIGKILL)
        flow_run.wait()
    assert not output.exists()  # killed before the end: no output that could pass for a whole one
    with Pool() as pool:  # answered once the worker has finished the request the dead flow process left
        pool.predict("embedder", {"inputs": []})
    served_before = requests()[:-1]
    before = stored()
    assert 1000 <= before < 2000
    assert before <= sum(served_before) <= before + 4 * 50  # at most the window in flight was computed twice

    again = _screen(pool_dir, input=str(inputs), chunk_size=50, output=str(output))
    assert again["computed"] == 2000 - before and again["from_store"] == before and again["ok"] == 2000
    served_after = requests()[len(served_before) + 1:]
    assert sum(served_after) == 2000 - before  # the provider computed only the rest
    assert len(served_after) == -(-(2000 - before) // 50)  # packed into full chunks
    records = _records(output)
    assert [r["index"] for r in records] == list(range(2000))  # every input once, in order
    assert [r["tokens"] for r in records] == [len(text) for text in texts]


def test_a_folder_is_an_inbox_one_output_per_file_and_unreadable_files_named(pool_dir, embedder, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    _jsonl(inbox / "monday.jsonl", _texts(20))
    (inbox / "tuesday.fasta").write_text("".join(f">t{n}\n{text}\n" for n, text in enumerate(_texts(25))))
    (inbox / "notes.txt").write_text("not an input: ignored by name\n")
    first = _state(pool_dir, input=str(inbox))
    assert first.is_completed() and first.message == "45 ok, 0 failed"
    assert sorted(p.name for p in (inbox / "screened").iterdir()) == [  # one output per file, each with its report
        "monday.jsonl.embedder.jsonl", "monday.jsonl.embedder.jsonl.report.html", "tuesday.fasta.embedder.jsonl",
        "tuesday.fasta.embedder.jsonl.report.html"]
    assert embedder() == 25  # tuesday's 25 include monday's 20 texts
    (inbox / "corrupt.fasta").write_bytes(os.urandom(5000))
    second = _state(pool_dir, input=str(inbox))
    assert second.is_failed() and "corrupt.fasta" in second.message and second.message.startswith("45 ok, 0 failed")
    assert embedder() == 25
    into_inbox = _state(pool_dir, input=str(inbox), output=str(inbox))
    assert into_inbox.is_failed() and "cannot go into the inbox itself" in into_inbox.message
    over_input = _state(pool_dir, input=str(inbox / "monday.jsonl"), output=str(inbox / "monday.jsonl"))
    assert over_input.is_failed() and "would replace its own input" in over_input.message
    assert json.loads((inbox / "monday.jsonl").read_text().splitlines()[0])["id"] == "s0"


def test_parquet_output_has_fixed_size_float32_embeddings(pool_dir, embedder, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install -e .[parquet])")
    import pyarrow as pa

    inputs = _jsonl(tmp_path / "in.jsonl", [*_texts(10), ""])
    _screen(pool_dir, input=str(inputs), output=str(tmp_path / "out.parquet"), format="parquet")
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names[:5] == ["id", "index", "ok", "reason", "error"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 2)
    rows = table.to_pylist()
    assert [r["index"] for r in rows] == list(range(11)) and rows[10]["ok"] is False
    assert rows[10]["embedding"] is None and rows[10]["reason"] == "bad_input"
    assert rows[0]["embedding"] == [float(len(_texts(10)[0])), float(sum(map(ord, _texts(10)[0])) % 997)]


# A structure-like provider: each item carries small per-residue arrays (numpy arrays on the client's side), one
# chunk-wide array with a row per input, and bytes.
ARRAY_ITEMS = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
import numpy

def on_predict(payload):
    texts = payload["inputs"]
    items = [{"plddt": numpy.full(len(t), 0.5, dtype=numpy.float32), "length": len(t), "tag": t[:3].encode()}
             for t in texts]
    lengths = numpy.array([[len(t), 2 * len(t)] for t in texts], dtype=numpy.int64)
    return {"items": items, "lengths": lengths, "scores": numpy.zeros(7, numpy.float32)}

worker_base.serve(slug="plddt", socket_path=sys.argv[1], on_predict=on_predict)
"""


def test_items_carrying_arrays_are_written_as_lists_of_numbers(pool_dir, tmp_path):
    """Issue 19's arrays through issue 15's campaign: every input gets its record, arrays as JSON numbers,
    bytes as base64, and a chunk-wide array's row (``lengths``) lands in its input's record (``length`` is
    the item's own and stays)."""
    (pool_dir / "plddt").mkdir()
    (pool_dir / "plddt" / "worker.py").write_text(ARRAY_ITEMS)
    (pool_dir / "plddt" / "manifest.toml").write_text('slug = "plddt"\nworker = "worker.py"\n')
    texts = _texts(20)
    output = tmp_path / "out.jsonl"
    state = _state(pool_dir, provider="plddt", input=str(_jsonl(tmp_path / "in.jsonl", texts)), chunk_size=8,
                   output=str(output), encoding="json")
    assert state.is_completed(), state.message
    records = _records(output)
    assert [r["ok"] for r in records] == [True] * 20, records[0]
    assert records[3]["plddt"] == [0.5] * len(texts[3]) and records[3]["length"] == len(texts[3])
    assert records[3]["tag"] == base64.b64encode(texts[3][:3].encode()).decode()
    assert "lengths" not in records[3] and "scores" not in records[3] and "score" not in records[3]


def test_the_chunk_wide_rows_go_to_their_items_without_numpy(monkeypatch):
    """A client without numpy gets arrays.Array objects: a chunk-wide array's rows still reach the items."""
    from resident_pool.arrays import Array
    from resident_pool.campaigns.answers import per_input

    answer = {"items": [{"tokens": 1}, {"tokens": 2}], "embeddings": Array(bytes(16), "float32", [2, 2]),
              "dim": 2}
    items = per_input(answer, 2)
    assert items == [{"tokens": 1, "embedding": [0.0, 0.0]}, {"tokens": 2, "embedding": [0.0, 0.0]}]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_minilm_with_array_encoding_writes_each_embedding_into_its_record(pool_dir, tmp_path):
    """minilm's embeddings come back as one attachment per chunk ("encoding": "array"); each record gets its row,
    the same float32 values the default base64 encoding writes."""
    import shutil

    shutil.copytree(ROOT / "manifests" / "minilm", pool_dir / "minilm")
    inputs = _jsonl(tmp_path / "in.jsonl", _texts(6))
    state = _state(pool_dir, provider="minilm", input=str(inputs), output=str(tmp_path / "array.jsonl"),
                   encoding="array", chunk_size=3)
    assert state.is_completed(), state.message
    _screen(pool_dir, provider="minilm", input=str(inputs), output=str(tmp_path / "b64.jsonl"), chunk_size=3)
    arrayed, encoded = _records(tmp_path / "array.jsonl"), _records(tmp_path / "b64.jsonl")
    assert all(r["ok"] for r in arrayed) and len(arrayed) == 6, state.message
    for mine, theirs in zip(arrayed, encoded, strict=True):
        expected = struct.unpack("<384f", base64.b64decode(theirs["embedding_f32"]))
        assert len(mine["embedding"]) == 384 and max(map(abs, (a - b for a, b in zip(mine["embedding"], expected,
                                                                                         strict=True)))) < 1e-6
        assert mine["tokens"] == theirs["tokens"]


# -- outside review of issue 15 (findings 2, 3, 4, 10, 11) ------------------------------------------------------------
_WORKER_HEAD = '''
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
worker_base = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker_base)
'''
# Items with fields a model may well name "id", "ok" or "index" (its own id for the input, an item-level ok).
_CLASHING = _WORKER_HEAD + '''
def on_predict(payload):
    return {"items": [{"id": "model-internal-7", "ok": False, "index": -1, "length": len(t)}
                      for t in payload["inputs"]]}
worker_base.serve(slug="clash", socket_path=sys.argv[1], on_predict=on_predict)
'''


@pytest.fixture
def clash(pool_dir):
    folder = pool_dir / "clash"
    folder.mkdir()
    (folder / "worker.py").write_text(_CLASHING)
    (folder / "manifest.toml").write_text('slug = "clash"\nworker = "worker.py"\n[lifecycle]\nmax_replicas = 1\n')


def _fasta(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(f">s{n}\n{t}\n" for n, t in enumerate(texts)))
    return path


def test_records_keep_their_own_id_index_and_ok_whatever_the_model_answers(pool_dir, clash, tmp_path):
    """An item holding id, index, ok, reason or error is kept whole under "result"; the record's own fields
    are the campaign's (JSON Lines cannot hold a key twice: the last would win)."""
    inputs = _fasta(tmp_path / "in.fasta", _texts(5))
    state = _state(pool_dir, input=str(inputs), provider="clash", output=str(tmp_path / "out.jsonl"))
    assert state.is_completed(), state.message
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["index"], r["id"], r["ok"]) for r in records] == [(n, f"s{n}", True) for n in range(5)], lines[0]
    assert all(line.count('"id"') == 2 and line.count('"ok"') == 2 for line in lines)  # one at each level
    assert records[0]["result"] == {"id": "model-internal-7", "ok": False, "index": -1, "length": 8}
    # Answered from the store the second time: the same records.
    again = _state(pool_dir, input=str(inputs), provider="clash", output=str(tmp_path / "again.jsonl"))
    assert again.result()["from_store"] == 5 and _records(tmp_path / "again.jsonl") == records


def test_parquet_output_with_result_fields_named_id_ok_and_index(pool_dir, clash, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install -e .[parquet])")
    inputs = _fasta(tmp_path / "in.fasta", _texts(5))
    state = _state(pool_dir, input=str(inputs), provider="clash", output=str(tmp_path / "out.parquet"),
                   format="parquet")
    assert state.is_completed(), state.message
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["id", "index", "ok", "reason", "error", "result"], table.schema
    assert table.column("id").to_pylist() == [f"s{n}" for n in range(5)]
    assert table.column("ok").to_pylist() == [True] * 5
    assert json.loads(table.column("result")[0].as_py())["id"] == "model-internal-7"


def test_a_tsv_with_a_stray_quote_loses_no_rows_in_the_campaign(pool_dir, embedder, tmp_path):
    stray = '"Uncharacterized protein'
    rows = ["Entry\tProtein names\tSequence"] + [
        f"P{i:05d}\t{stray if i == 10 else f'protein {i}'}\tMKVLL{t}" for i, t in enumerate(_texts(2000))]
    tsv = tmp_path / "uniprot.tsv"
    tsv.write_text("\n".join(rows) + "\n")
    state = _state(pool_dir, input=str(tsv), id_column="Entry", output=str(tmp_path / "out.jsonl"))
    records = _records(tmp_path / "out.jsonl")
    assert len(records) == 2000, f"2000 rows in, {len(records)} records out; run: {state.message!r}"
    assert state.message == "2000 ok, 0 failed" and records[10]["id"] == "P00010"


def test_two_input_files_with_the_same_name_do_not_share_a_default_output(pool_dir, embedder, tmp_path,
                                                                        monkeypatch):
    """The default output sits next to its input (as an inbox's go to <inbox>/screened), never in the code
    checkout and never shared by two inputs of the same name; wherever the run starts."""
    (tmp_path / "2024").mkdir()
    (tmp_path / "2025").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    first = _fasta(tmp_path / "2024" / "seqs.fasta", _texts(5))
    second = _fasta(tmp_path / "2025" / "seqs.fasta", _texts(7, salt="W"))
    before = set((ROOT / "out").iterdir()) if (ROOT / "out").exists() else set()
    one = _screen(pool_dir, input=str(first))
    two = _screen(pool_dir, input=str(second))
    assert one["output"] == str(tmp_path / "2024" / "seqs.fasta.embedder.jsonl")
    assert two["output"] == str(tmp_path / "2025" / "seqs.fasta.embedder.jsonl")
    assert len(_records(Path(one["output"]))) == 5 and len(_records(Path(two["output"]))) == 7
    assert (set((ROOT / "out").iterdir()) if (ROOT / "out").exists() else set()) == before
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_pool_started_by_another_path_to_the_same_interpreter_serves_the_campaign(pool_dir, embedder, tmp_path,
                                                                                  isolated_dirs):
    """`python3 flows/screen.py` against a pool that the `resident-pool` script (#!.venv/bin/python) started:
    the same venv, the same worker, the same provider version, the same answers."""
    other = Path(sys.executable).with_name("python3" if Path(sys.executable).name != "python3" else "python")
    assert other.exists() and str(other) != sys.executable
    state_dir = Path(isolated_dirs["state"])
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(tmp_path / "pool.log", "a") as log:  # as Pool._start_pool does: a file, not a pipe
        subprocess.run([str(other), "-P", "-m", "resident_pool", "daemon", "--background", "--manifests",
                        str(pool_dir)], cwd=state_dir, check=True, timeout=60, stdin=subprocess.DEVNULL, stdout=log,
                       stderr=subprocess.STDOUT)
    wait_until(lambda: os.path.exists(state_dir / "pool.sock"), timeout=30, message="the pool")
    inputs = _fasta(tmp_path / "in.fasta", _texts(10))
    state = _state(pool_dir, input=str(inputs), output=str(tmp_path / "out.jsonl"))
    records = _records(tmp_path / "out.jsonl")
    reasons = {r.get("reason") for r in records if not r["ok"]}
    assert all(r["ok"] for r in records), f"{state.message}; reasons {reasons}; e.g. {records[0].get('error')}"
    assert embedder() == 10


@pytest.mark.parametrize("name", ["embedder/../clash", "embedder\n", "embedder/", "../manifests/embedder"])
def test_the_screen_flow_takes_a_provider_name_not_a_path(pool_dir, embedder, clash, tmp_path, name):
    inputs = _fasta(tmp_path / "in.fasta", _texts(3))
    state = _state(pool_dir, input=str(inputs), provider=name, output=str(tmp_path / "out.jsonl"))
    assert state.is_failed() and "is not a provider name" in state.message, state.message
    assert embedder() == 0 and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("name", ["embedder/../clash", "embedder\n"])
@pytest.mark.parametrize("given", [{}, {"sequences": ["MKV"]}, {"payload": {"inputs": ["MKV"]}}],
                         ids=["smoke payload", "sequences given", "payload given"])
def test_the_predict_flow_takes_a_provider_name_not_a_path(pool_dir, embedder, clash, name, given):
    from predict import predict

    state = predict(provider=name, return_state=True, **given)
    assert state.is_failed() and "is not a provider name" in state.message, state.message
    assert embedder() == 0


def test_the_deployment_offers_only_folders_named_as_providers(pool_dir, embedder):
    from deploy import provider_choices

    (pool_dir / "embedder.old").mkdir()
    (pool_dir / "embedder.old" / "manifest.toml").write_text((pool_dir / "embedder" / "manifest.toml").read_text())
    assert provider_choices(pool_dir) == ["embedder"]


def test_two_runs_writing_one_output_at_once_the_second_is_refused_and_computes_nothing(pool_dir, embedder,
                                                                                        tmp_path):
    """Two runs on one inbox at once (a slow night, a hand-started run): one campaign writes an output at a time;
    the other is refused by name, computes nothing, and a later run is served as usual."""
    from resident_pool.campaigns.campaign import Campaign
    from resident_pool.campaigns.results import ResultStore

    inputs = _fasta(tmp_path / "in.fasta", _texts(5))
    output = tmp_path / "out.jsonl"
    with ResultStore(tmp_path / "other-store" / "embedder.sqlite3") as store:
        holder = Campaign(store, "v", {}, 8, output)  # another run, writing the same output now
        try:
            refused = _state(pool_dir, input=str(inputs), output=str(output))
        finally:
            holder.close()
    assert refused.is_failed() and "another campaign is writing" in refused.message, refused.message
    assert embedder() == 0 and not output.exists()
    served = _state(pool_dir, input=str(inputs), output=str(output))
    assert served.is_completed() and served.message == "5 ok, 0 failed"
    assert len(_records(output)) == 5 and not output.with_name("out.jsonl.partial").exists()


_APPENDER = _WORKER_HEAD + '''
appended = False
def on_predict(payload):
    global appended
    if not appended:  # the inbox file grows while the campaign reads it (a copy still going on)
        with open(os.environ["APPEND_TO"], "a") as out:
            out.write(">late\\nGGGG\\n")
        appended = True
    return {"items": [{"length": len(t)} for t in payload["inputs"]]}
worker_base.serve(slug="appender", socket_path=sys.argv[1], on_predict=on_predict)
'''


def test_an_inbox_file_that_changes_while_it_is_read_gets_no_mixed_output(pool_dir, tmp_path, monkeypatch):
    """Review of issue 15, Risks: the run names the file and writes no output for it (none mixing two versions);
    what was computed is stored, so the next run computes only the rest."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    growing = _fasta(inbox / "growing.fasta", _texts(3000))
    os.utime(growing, (1_700_000_000, 1_700_000_000))  # written a while ago
    monkeypatch.setenv("APPEND_TO", str(growing))
    folder = pool_dir / "appender"
    folder.mkdir()
    (folder / "worker.py").write_text(_APPENDER)
    (folder / "manifest.toml").write_text('slug = "appender"\nworker = "worker.py"\n[env]\npassthrough = '
                                          '["APPEND_TO"]\n[lifecycle]\nmax_replicas = 1\n')
    first = _state(pool_dir, input=str(inbox), provider="appender", chunk_size=8)
    assert first.is_failed() and "growing.fasta: the file changed while it was read" in first.message, first.message
    assert not (inbox / "screened" / "growing.fasta.appender.jsonl").exists()
    second = _state(pool_dir, input=str(inbox), provider="appender", chunk_size=8)
    assert second.is_completed() and second.message == "3001 ok, 0 failed", second.message
    summary = second.result()  # the first run's computed chunks were kept; it stopped reading at the change
    assert summary["from_store"] >= 1000 and summary["computed"] + summary["from_store"] == 3001, summary


# -- review round 3 (issue 24): one bad value fails one record; the operator bounds what an input can cost ---------
_F32 = _WORKER_HEAD + '''
import base64, struct
def on_predict(payload):
    items = []
    for text in payload["inputs"]:
        vector = base64.b64encode(struct.pack("<4f", len(text), 1.0, 2.0, 3.0)).decode()
        items.append({"embedding_f32": "abc" if "BAD" in text else vector, "tokens": len(text)})
    return {"items": items}
worker_base.serve(slug="f32", socket_path=sys.argv[1], on_predict=on_predict)
'''


def _inline_provider(pool_dir: Path, slug: str, source: str, extra: str = "") -> None:
    folder = pool_dir / slug
    folder.mkdir()
    (folder / "worker.py").write_text(source)
    (folder / "manifest.toml").write_text(f'slug = "{slug}"\nworker = "worker.py"\n[lifecycle]\nmax_replicas = 1\n'
                                          + extra)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_one_item_with_bad_base64_fails_its_record_alone_in_parquet_and_jsonl_and_is_never_stored(pool_dir,
                                                                                                  tmp_path, fmt):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install -e .[parquet])")
    _inline_provider(pool_dir, "f32", _F32)
    inputs = _fasta(tmp_path / "in.fasta", [*_texts(4), "MKVBADKV"])
    output = tmp_path / f"out.{fmt}"
    for run in (1, 2):  # the second run is served from the store: the bad answer was never kept
        state = _state(pool_dir, input=str(inputs), provider="f32", output=str(output), format=fmt)
        assert state.is_completed() and state.message.startswith("4 ok, 1 failed; failed inputs: "), state.message
        assert state.result()["from_store"] == (4 if run == 2 else 0)
        table = pq.read_table(output).to_pylist() if fmt == "parquet" else _records(output)
        assert [row["ok"] for row in table] == [True] * 4 + [False]
        bad = table[4]
        assert bad["reason"] == "bad_answer" and "embedding_f32: not base64 float32 text" in bad["error"], bad
        assert table[0]["embedding" if fmt == "parquet" else "embedding_f32"] is not None


def test_a_stored_answer_an_older_version_could_not_write_fails_its_row_and_is_computed_again(pool_dir, tmp_path):
    """The store of a version before the check may hold such an answer: every Parquet run over that input then
    ended in binascii.Error, with no output."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install -e .[parquet])")
    from resident_pool.campaigns.results import ResultStore, options_text, provider_version, result_key
    from resident_pool.providers.manifest import load_manifest
    from resident_pool.settings import settings

    _inline_provider(pool_dir, "f32", _F32)
    texts = _texts(3)
    inputs = _fasta(tmp_path / "in.fasta", texts)
    version = provider_version(load_manifest(pool_dir / "f32" / "manifest.toml"))
    key = result_key(version, options_text({"encoding": "float32-base64"}), texts[1])
    with ResultStore.for_provider("f32", settings().results_dir) as store:
        store.put(version, [(key, '{"embedding_f32":"abc","tokens":8}')])
    output = tmp_path / "out.parquet"
    state = _state(pool_dir, input=str(inputs), provider="f32", output=str(output), format="parquet")
    assert state.is_completed() and state.message.startswith("2 ok, 1 failed; failed inputs: "), state.message
    rows = pq.read_table(output).to_pylist()
    assert [row["ok"] for row in rows] == [True, False, True] and "computes it again" in rows[1]["error"]
    again = _state(pool_dir, input=str(inputs), provider="f32", output=str(output), format="parquet")
    assert again.is_completed() and again.message == "3 ok, 0 failed", again.message
    assert [row["embedding"][0] for row in pq.read_table(output).to_pylist()] == [float(len(t)) for t in texts]


_NAN = _WORKER_HEAD + '''
import numpy
def on_predict(payload):
    # A model's NaN (an fp16 overflow) in one input's array.
    return {"items": [{"length": len(text), "scores": numpy.array([1.0, float("nan") if "NAN" in text else 2.0],
                                                                  dtype=numpy.float32)}
                      for text in payload["inputs"]]}
worker_base.serve(slug="nans", socket_path=sys.argv[1], on_predict=on_predict)
'''


def _strict_json(line: str) -> dict:
    """A line as a strict reader (jq, JSON.parse) reads it: NaN and Infinity are no JSON."""
    def refuse(name):
        raise ValueError(f"{name} is no JSON")
    return json.loads(line, parse_constant=refuse)


def test_a_nan_in_an_answer_fails_its_record_as_bad_answer_and_is_never_stored(pool_dir, tmp_path):
    """Python's encoder writes a NaN as `NaN`, which no strict JSON reader takes: the line was unreadable and
    the store kept it. docs/security.md: an answer the writer cannot write fails that input's record."""
    _inline_provider(pool_dir, "nans", _NAN)
    inputs = _jsonl(tmp_path / "in.jsonl", [*_texts(2), "MKVNANKV", *_texts(3, salt="B")])
    output = tmp_path / "out.jsonl"
    for run in (1, 2):  # the second run computes the NaN again: it was never stored
        state = _state(pool_dir, input=str(inputs), provider="nans", chunk_size=3, output=str(output),
                       encoding="array")
        assert state.is_completed() and state.message.startswith("5 ok, 1 failed; failed inputs: "), state.message
        assert state.result()["from_store"] == (5 if run == 2 else 0)
        records = [_strict_json(line) for line in output.read_text().splitlines()]
        assert [r["ok"] for r in records] == [True, True, False, True, True, True]
        assert records[2]["reason"] == "bad_answer" and "a NaN or an infinity" in records[2]["error"], records[2]
        assert records[0]["scores"] == [1.0, 2.0]


_SIZES = _WORKER_HEAD + '''
import base64, struct
def on_predict(payload):
    dims = lambda text: 3 if "ODD" in text else 4
    return {"items": [{"length": len(text),
                       "embedding_f32": base64.b64encode(struct.pack(f"<{dims(text)}f", *range(dims(text)))).decode()}
                      for text in payload["inputs"]]}
worker_base.serve(slug="sizes", socket_path=sys.argv[1], on_predict=on_predict)
'''


def test_a_parquet_embedding_of_another_size_fails_its_row_and_is_not_kept(pool_dir, tmp_path):
    """The embedding column is a fixed-size list sized from the first answer: a row with 3 floats where it holds
    4 was written ok with a null, and stayed in the store as good."""
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install -e .[parquet])")
    _inline_provider(pool_dir, "sizes", _SIZES)
    inputs = _jsonl(tmp_path / "in.jsonl", [*_texts(4), "MKVODDKV", *_texts(1, salt="B")])
    output = tmp_path / "out.parquet"
    for run in (1, 2):  # the odd answer was removed from the store, so the second run computes it again
        state = _state(pool_dir, input=str(inputs), provider="sizes", chunk_size=3, output=str(output),
                       format="parquet")
        assert state.is_completed() and state.message.startswith("5 ok, 1 failed; failed inputs: "), state.message
        assert state.result()["computed"] == (6 if run == 1 else 1)
        rows = pq.read_table(output).to_pylist()
        assert [row["ok"] for row in rows] == [True] * 4 + [False, True]
        assert all(row["embedding"] == [0.0, 1.0, 2.0, 3.0] for row in rows if row["ok"]), rows
        assert rows[4]["reason"] == "bad_answer" and "3 floats, where the output's column holds 4" in \
            rows[4]["error"], rows[4]


def _as_whole(result: dict) -> str:
    """A result's text as it was written before arrays went by blocks: each array as one Python list."""
    from resident_pool import arrays

    return json.dumps(result, separators=(",", ":"), allow_nan=False, default=arrays.plain)


@pytest.mark.parametrize("shape", [(200_000,), (300, 700), (3, 70_001), (2, 3, 40_000), (65_537, 1)])
@pytest.mark.parametrize("dtype", ["float32", "int64", "bool"])
@pytest.mark.parametrize("kind", ["numpy", "Array"])
def test_a_large_array_is_written_by_blocks_as_the_same_text_as_whole(shape, dtype, kind):
    numpy = pytest.importorskip("numpy")
    from resident_pool.arrays import Array
    from resident_pool.campaigns.campaign import DEFAULT_MAX_RESULT_BYTES, _written

    values = numpy.random.default_rng(7).normal(size=shape).astype(numpy.float32)
    values = (values > 0) if dtype == "bool" else values.astype(dtype)
    wrapped = values if kind == "numpy" else Array(values.tobytes(), dtype, shape)
    result = {"items": [{"scores": wrapped, "note": "a string"}], "tail": wrapped, "small": values[:3]}
    text, problem = _written(result, DEFAULT_MAX_RESULT_BYTES)
    assert problem is None and text == _as_whole({**result, "items": [{"scores": values, "note": "a string"}],
                                                  "tail": values})


def test_a_large_array_holding_a_nan_or_past_the_limit_as_text_fails_its_record():
    numpy = pytest.importorskip("numpy")
    from resident_pool.campaigns.campaign import _written

    small = numpy.zeros(100_000, numpy.int8)  # 100 kB decoded, 200 kB as text ("0,")
    assert _written({"v": small}, 250_000) == (_as_whole({"v": small}), None)
    assert _written({"v": small}, 150_000)[1] == ("the answer is more than 150000 bytes as JSON "
                                                  "(RESIDENT_POOL_MAX_RESULT_BYTES); it was not written")
    values = numpy.zeros(100_000, numpy.float32)
    values[99_999] = numpy.nan
    assert "a NaN or an infinity" in _written({"v": values}, 500_000)[1]


WRITE_A_SPARSE_ANSWER = """
import mmap, os, resource, sys
import numpy
from resident_pool.arrays import Array
from resident_pool.campaigns.campaign import DEFAULT_MAX_RESULT_BYTES, _written
fd = os.memfd_create("answer")
os.ftruncate(fd, 40_000_000)  # sparse: the worker paid nothing for it
mapped = mmap.mmap(fd, 40_000_000, prot=mmap.PROT_READ)
values = numpy.frombuffer(mapped, numpy.float32) if sys.argv[1] == "numpy" else Array(mapped, "float32", [10_000_000])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
text, problem = _written({"embedding": values}, DEFAULT_MAX_RESULT_BYTES)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, len(text), problem is None)
"""


@pytest.mark.parametrize("kind", ["numpy", "Array"])
def test_a_40_mb_sparse_answer_under_the_limit_costs_at_most_four_times_its_size_to_write(kind):
    """Issue 24 finding 5: a worker's 40 MB sparse attachment raised the campaign's peak by 463 MB, written as
    one Python list of 10 million floats; under the 64 MiB result limit it still did. By blocks: the mapping's
    40 MB read, the text twice while it is joined. Measured here: 259 MB before, 117 MB after."""
    done = subprocess.run([sys.executable, "-c", WRITE_A_SPARSE_ANSWER, kind], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rise_mb, written, ok = done.stdout.split()
    assert ok == "True" and int(written) == 40_000_015
    assert float(rise_mb) <= 160, f"writing a 40 MB answer raised the peak by {rise_mb} MB"


def test_a_file_over_a_record_limit_lowered_to_1000_is_refused_whole_and_the_inbox_goes_on(pool_dir, embedder,
                                                                                        tmp_path, monkeypatch):
    """The limit is lowered from 50 million so the test need not make them: a 7 kB .gz held a million."""
    monkeypatch.setenv("RESIDENT_POOL_MAX_INPUT_RECORDS", "1000")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    with gzip.open(inbox / "bomb.fasta.gz", "wb") as out:
        out.write(b">x\nMKVLAAGIV\n" * 1001)
    _fasta(inbox / "fine.fasta", _texts(5))
    state = _state(pool_dir, input=str(inbox))
    assert state.is_failed() and state.message.startswith("5 ok, 0 failed"), state.message
    assert "bomb.fasta.gz: more than 1,000 records (RESIDENT_POOL_MAX_INPUT_RECORDS)" in state.message
    assert sorted(p.name for p in (inbox / "screened").iterdir() if not p.name.endswith(".partial")) == [
        "fine.fasta.embedder.jsonl", "fine.fasta.embedder.jsonl.report.html"]  # nothing of the refused file


def test_a_file_that_decompresses_past_a_byte_limit_lowered_to_100_kb_is_refused(pool_dir, embedder, tmp_path,
                                                                              monkeypatch):
    """Lowered from 10 GB so the test need not decompress that much."""
    monkeypatch.setenv("RESIDENT_POOL_MAX_INPUT_BYTES", "100000")
    bomb = tmp_path / "bomb.fasta.gz"
    with gzip.open(bomb, "wb") as out:
        out.write(b">x\n" + b"MKVLAAGIV" * 100_000 + b"\n")  # one record, 900 kB decompressed
    output = tmp_path / "out.jsonl"
    state = _state(pool_dir, input=str(bomb), output=str(output))
    assert state.is_failed() and "more than 100,000 bytes decompressed (RESIDENT_POOL_MAX_INPUT_BYTES)" in \
        state.message, state.message
    assert not output.exists()


_BIG = _WORKER_HEAD + '''
def on_predict(payload):
    return {"items": [{"blob": "x" * 300_000 if "BIG" in text else "small"} for text in payload["inputs"]]}
worker_base.serve(slug="big", socket_path=sys.argv[1], on_predict=on_predict)
'''


def test_a_result_over_a_size_limit_lowered_to_100_kb_fails_alone_and_is_not_stored(pool_dir, tmp_path,
                                                                                   monkeypatch):
    """Lowered from 64 MiB so the test need not make an answer that large."""
    monkeypatch.setenv("RESIDENT_POOL_MAX_RESULT_BYTES", "100000")
    _inline_provider(pool_dir, "big", _BIG)
    inputs = _fasta(tmp_path / "in.fasta", ["MKVBIGKV", *_texts(2)])
    state = _state(pool_dir, input=str(inputs), provider="big", output=str(tmp_path / "out.jsonl"))
    assert state.is_completed() and state.message.startswith("2 ok, 1 failed; failed inputs: "), state.message
    bad = _records(tmp_path / "out.jsonl")[0]
    assert bad["reason"] == "bad_answer" and "over 100000 bytes decoded (RESIDENT_POOL_MAX_RESULT_BYTES)" in \
        bad["error"]
    again = _state(pool_dir, input=str(inputs), provider="big", output=str(tmp_path / "again.jsonl"))
    assert again.result()["from_store"] == 2  # the oversized answer was not kept


_ATTACHED = _WORKER_HEAD + '''
def on_predict(payload):
    inputs = payload.get("inputs") or ["one"]
    return {"items": [{"blob": bytes(2_000_000)} for _ in inputs]}
worker_base.serve(slug="attached", socket_path=sys.argv[1], on_predict=on_predict)
'''


def test_a_campaign_maps_less_of_an_answer_than_a_direct_call_cap_lowered_to_1_mb(pool_dir, tmp_path, monkeypatch):
    """Lowered from 1 GiB so the test need not send that much: a direct call still takes the 2 MB answer."""
    monkeypatch.setenv("RESIDENT_POOL_CAMPAIGN_MAX_ATTACHMENT_BYTES", "1000000")
    _inline_provider(pool_dir, "attached", _ATTACHED)
    with Pool() as pool:
        assert len(pool.predict("attached", {})["items"][0]["blob"]) == 2_000_000
    inputs = _fasta(tmp_path / "in.fasta", _texts(2))
    state = _state(pool_dir, input=str(inputs), provider="attached", output=str(tmp_path / "out.jsonl"))
    assert state.is_completed() and state.message.startswith("0 ok, 2 failed; failed inputs: "), state.message
    record = _records(tmp_path / "out.jsonl")[0]
    assert record["reason"] == "request_failed" and "attachment cap of 1000000 bytes" in record["error"], record


def test_inputs_an_open_breaker_refused_are_recorded_with_what_opened_it_and_how_to_reset_it(pool_dir, embedder,
                                                                                              tmp_path, monkeypatch):
    """The report: a campaign record served by the breaker said start_failed, with no word of the breaker."""
    from helpers import RefusingClient, breaker_open

    import resident_pool.prefect as face

    monkeypatch.setattr(face, "_client", lambda manifests: RefusingClient(breaker_open("embedder"), pool_dir))
    state = _state(pool_dir, input=str(_jsonl(tmp_path / "in.jsonl", _texts(5))), output=str(tmp_path / "out.jsonl"))
    assert state.is_failed() and state.message.startswith("0 ok, 5 failed: embedder never started: "), state.message
    assert "closes in 157 s" in state.message  # the breaker's own words, with the start failure they quote
    (run,) = settled_task_runs(state, 1)
    assert run.run_count == 1  # not retried
    records = _records(tmp_path / "out.jsonl")
    assert {r["reason"] for r in records} == {"breaker_open"}
    for words in ("closes in 157 s", "resident-pool stop embedder", "exit code 3"):
        assert words in records[0]["error"], records[0]["error"]


# -- speed (issue 27) --------------------------------------------------------------------------------------------
def test_a_fast_model_gets_fewer_task_runs_than_requests_and_every_request_keeps_the_chunk_size(pool_dir, embedder,
                                                                                               tmp_path):
    """Each task run costs the Prefect server and the flow tens of milliseconds: with a model this fast, runs grow to
    many requests of chunk_size each, once the first runs have measured it."""
    summary = _screen(pool_dir, input=str(_jsonl(tmp_path / "in.jsonl", _texts(5000))), chunk_size=50,
                      output=str(tmp_path / "out.jsonl"))
    assert summary["ok"] == 5000
    requests = [int(line) for line in (tmp_path / "computed.log").read_text().split()]
    assert sum(requests) == 5000 and max(requests) == 50
    assert summary["chunks"] < len(requests) // 2, (summary["chunks"], len(requests))  # task runs launched
    assert [r["index"] for r in _records(tmp_path / "out.jsonl")] == list(range(5000))


def test_a_slow_first_chunk_holds_the_reader_back_at_the_backlog_lowered_to_3000(tmp_path, monkeypatch):
    """The output goes in input order, so what is read behind a chunk still computing waits in memory: past the
    backlog the flow stops reading until it is written (lowered from 131,072 so the file can be small)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from screen import _FileRun

    from resident_pool.campaigns.campaign import Campaign, CampaignSettings
    from resident_pool.campaigns.inputs import InputFile
    from resident_pool.campaigns.progress import FileProgress
    from resident_pool.campaigns.results import ResultStore

    monkeypatch.setattr(Campaign, "BACKLOG", 3000)
    held_back, most = threading.Event(), []
    hold_back = _FileRun.hold_back

    def watched(self):
        most.append(self.campaign.backlog)
        if self.campaign.backlog > Campaign.BACKLOG:
            held_back.set()
        hold_back(self)

    monkeypatch.setattr(_FileRun, "hold_back", watched)

    def work(params):
        texts = params["texts"].items
        if params["label"].startswith("0-"):
            assert held_back.wait(timeout=60)  # the first chunk answers only once the reader has stopped
        return {"results": [{"n": len(text)} for text in texts], "failed": {}, "cold": False, "pid": 1,
                "version": None, "latency_s": 0.0, "compute_s": 0.0}

    class Progress:
        def update(self, *_, **__):
            pass

    store = ResultStore.for_provider("p", tmp_path / "store")
    campaign = Campaign(store, "v", {}, chunk_size=100, output=tmp_path / "out.jsonl")
    with ThreadPoolExecutor(2) as pool:
        run = _FileRun(InputFile(_jsonl(tmp_path / "in.jsonl", _texts(20_000))), campaign,
                       FileProgress("in.jsonl", 20_000), provider="p", manifests="m",
                       options={}, submit=lambda _fn, params: pool.submit(work, params), window=4,
                       progress=Progress(), limits=CampaignSettings(results_dir=tmp_path / "store"))
        run.run()
    assert held_back.is_set() and max(most) <= 3000 + 1024  # at most one block read past the backlog
    assert campaign.write("jsonl")["ok"] == 20_000
    campaign.close()
    store.close()
    assert [r["index"] for r in _records(tmp_path / "out.jsonl")] == list(range(20_000))


SMALL_DISK = 'mount -t tmpfs -o size=96k tmpfs "$SMALL" && exec "$@"'


@pytest.mark.reliability
@pytest.mark.parametrize("full", ["output", "store"])
def test_a_full_disk_ends_the_run_with_a_sentence_naming_the_file_and_the_fix_and_nothing_is_lost(
        pool_dir, embedder, tmp_path, full, reliability_row):
    """Issue 31 finding 11: a campaign whose store or output filled its disk ended with `OperationalError: database
    or disk is full` or `OSError: [Errno 28]` and a traceback naming no file, and its progress said 100% of what it
    had read. A 96 KB filesystem of its own (tmpfs, in a mount namespace of the run's own: nothing of the host's is
    mounted) holds the output or the store."""
    from prefect.settings import PREFECT_API_URL

    if os.getuid() != 0 or subprocess.run(["unshare", "--mount", "true"], capture_output=True,
                                          check=False).returncode != 0:
        pytest.skip("needs root and a mount namespace to give the run a small filesystem of its own")
    small = tmp_path / "small"
    small.mkdir()
    inputs = tmp_path / "in.fasta"
    inputs.write_text("".join(f">s{n}\n{text}\n" for n, text in enumerate(_texts(3000))))
    output = (small if full == "output" else tmp_path) / "out.jsonl"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "SMALL": str(small)}
    if full == "store":
        env["RESIDENT_POOL_RESULTS_DIR"] = str(small / "results")
    argv = [sys.executable, str(ROOT / "flows" / "screen.py"), "--input", str(inputs), "--provider", "embedder",
            "--manifests", str(pool_dir), "--output", str(output), "--chunk-size", "100", "--no-report"]
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", SMALL_DISK, "sh", *argv],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    named = str(output) if full == "output" else str(small / "results" / "embedder.sqlite3")
    error = said[said.index("error: "):]
    assert named in error and "no space left" in error and "free space" in error, error
    progress = [line for line in said.splitlines() if "inputs done (" in line]
    assert progress and not [line for line in progress if "(100.0%)" in line], progress
    assert "3,000 inputs" in progress[-1] and "stopped" in progress[-1], progress[-1]
    if full == "store":  # it went with its filesystem: the next run computes everything again, nothing to see
        reliability_row("campaign's store fills its disk", "one sentence naming the store and the fix; progress "
                        "short of 100%")
        return
    # Space freed (the same run on a roomy disk): every input is written exactly once; what was stored is kept.
    with contextlib.closing(sqlite3.connect(Path(os.environ["RESIDENT_POOL_RESULTS_DIR"]) / "embedder.sqlite3")) \
            as kept:
        stored = kept.execute("SELECT count(*) FROM results").fetchone()[0]
    before = embedder()
    again = _state(pool_dir, input=str(inputs), output=str(tmp_path / "again.jsonl"), chunk_size=100, report=False)
    assert again.message == "3000 ok, 0 failed"
    assert sorted(r["index"] for r in _records(tmp_path / "again.jsonl")) == list(range(3000))
    assert stored > 0 and embedder() - before == 3000 - stored  # what the first run stored is not computed again
    reliability_row("campaign's output fills its disk", "one sentence naming the output and the fix; progress short "
                    "of 100%; the re-run wrote every input once")


def test_a_report_its_disk_has_no_room_for_ends_the_run_naming_it_and_the_output_is_whole(pool_dir, embedder,
                                                                                         tmp_path, monkeypatch):
    """Issue 31 finding 11, the report beside the output: its write failing for room is the same sentence."""
    import errno

    import screen

    def full(path, **_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(screen, "write_report", full)
    inputs = _jsonl(tmp_path / "in.jsonl", _texts(10))
    state = _state(pool_dir, input=str(inputs), output=str(tmp_path / "out.jsonl"))
    assert state.is_failed()
    assert state.message.startswith(f"{tmp_path / 'out.jsonl'}.report.html: no space left on device while writing "
                                     "the report"), state.message
    assert len(_records(tmp_path / "out.jsonl")) == 10
