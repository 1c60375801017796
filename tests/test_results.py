"""resident_pool.campaigns.results and the campaign's output: keyed by content, safe between campaigns and users."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
from pathlib import Path

import pytest
from helpers import configured

from resident_pool.campaigns.campaign import Campaign, CampaignSettings
from resident_pool.campaigns.inputs import Record
from resident_pool.campaigns.results import ResultStore, default_results_dir, options_text, result_key
from resident_pool.errors import InputError, ResidentPoolError, StateDirError


def test_a_key_is_the_text_version_and_options_never_the_position_or_id():
    key = result_key("v1", options_text({"encoding": "f32", "a": 1}), "MKV")
    assert key == result_key("v1", options_text({"a": 1, "encoding": "f32"}), "MKV")  # option order is not content
    assert len({key, result_key("v2", options_text({"encoding": "f32", "a": 1}), "MKV"),
                result_key("v1", options_text({}), "MKV"), result_key("v1", options_text({"encoding": "f32", "a": 1}),
                                                                      "MKVL")}) == 4


def test_the_store_lives_in_the_users_data_folder_unless_set(tmp_path, monkeypatch):
    monkeypatch.delenv("RESIDENT_POOL_RESULTS_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert CampaignSettings.of(*configured()).results_dir == tmp_path / "data" / "resident-pool" / "results"
    assert default_results_dir().name == "results"
    monkeypatch.setenv("RESIDENT_POOL_RESULTS_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("RESIDENT_POOL_MAX_RECORD_BYTES", "4096")
    settings = CampaignSettings.of(*configured())
    assert settings.results_dir == tmp_path / "elsewhere" and settings.max_record_bytes == 4096
    monkeypatch.setenv("RESIDENT_POOL_MAX_RECORD_BYTES", "1MB")
    with pytest.raises(ResidentPoolError, match="RESIDENT_POOL_MAX_RECORD_BYTES='1MB'"):
        configured()


def test_put_keeps_the_first_result_and_present_finds_what_is_stored(tmp_path):
    with ResultStore.for_provider("minilm", tmp_path / "store") as store:
        keys = [result_key("v", "{}", text) for text in ("a", "b", "c")]
        store.put("v", [(keys[0], '{"x":1}'), (keys[1], '{"x":2}')])
        store.put("v", [(keys[0], '{"x":99}')])
        assert store.present(keys) == set(keys[:2]) and store.get(keys[0]) == {"x": 1}
        store.put("old", [(keys[2], "{}")])
        assert store.count() == 3 and store.prune(keep_version="v") == 1 and store.count() == 2
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700


def _writer(path, start, count):
    with ResultStore(path) as store:
        for n in range(start, start + count, 10):
            store.put("v", [(result_key("v", "{}", str(i)), json.dumps({"n": i})) for i in range(n, n + 10)])


def test_two_campaigns_writing_one_store_at_once_lose_nothing(tmp_path):
    path = tmp_path / "store" / "embedder.sqlite3"
    ResultStore(path).close()
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_writer, args=(path, start, 2000)) for start in (0, 1000, 3000)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [writer.exitcode for writer in writers] == [0, 0, 0]
    with ResultStore(path) as store:
        assert store.count() == 5000  # 0..4999, the overlap stored once


def test_a_store_that_is_a_symlink_or_in_an_open_folder_is_refused(tmp_path):
    private = tmp_path / "store"
    private.mkdir(mode=0o700)
    (tmp_path / "elsewhere.sqlite3").write_bytes(b"")
    (private / "minilm.sqlite3").symlink_to(tmp_path / "elsewhere.sqlite3")
    with pytest.raises(ResidentPoolError, match="not a plain file"):
        ResultStore.for_provider("minilm", private)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StateDirError, match="RESIDENT_POOL_RESULTS_DIR"):
        ResultStore.for_provider("minilm", shared)


def _campaign(tmp_path, output):
    store = ResultStore.for_provider("p", tmp_path / "store")
    return store, Campaign(store, "v", {}, chunk_size=2, output=output)


def test_the_output_replaces_a_symlink_instead_of_writing_through_it_and_keeps_the_umask(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("someone else's file\n")
    output = tmp_path / "out" / "result.jsonl"
    output.parent.mkdir()
    output.symlink_to(target)
    old_umask = os.umask(0o027)
    try:
        store, campaign = _campaign(tmp_path, output)
        assert campaign.add([Record(0, "a", "MKV", 1), Record(1, "b", "", 2, "bad")]) == []
        (chunk,) = campaign.flush()
        campaign.finish(chunk, [{"x": 1}], {}, {})
        campaign.write("jsonl")
        campaign.close()
        store.close()
    finally:
        os.umask(old_umask)
    assert target.read_text() == "someone else's file\n"
    assert not output.is_symlink() and stat.S_IMODE(output.stat().st_mode) == 0o640
    assert [json.loads(line)["ok"] for line in output.read_text().splitlines()] == [True, False]


def test_a_symlink_at_the_partial_journal_is_refused(tmp_path):
    output = tmp_path / "result.jsonl"
    (tmp_path / "result.jsonl.partial").symlink_to(tmp_path / "victim")
    store = ResultStore.for_provider("p", tmp_path / "store")
    with pytest.raises(InputError, match="symlink is never followed"):
        Campaign(store, "v", {}, chunk_size=2, output=output)
    store.close()
    assert not (tmp_path / "victim").exists()


def test_duplicates_in_flight_are_computed_once_and_every_input_gets_its_record(tmp_path):
    store, campaign = _campaign(tmp_path, tmp_path / "out.jsonl")
    records = [Record(i, f"r{i}", text, i + 1) for i, text in enumerate(["A", "B", "A", "C", "B", "A"])]
    chunks = campaign.add(records) + campaign.flush()
    assert [chunk.texts for chunk in chunks] == [["A", "B"], ["C"]]
    assert [(chunk.first, chunk.last) for chunk in chunks] == [(0, 1), (3, 3)]
    campaign.finish(chunks[0], [{"v": "a"}, None], {1: ("request_failed", "B refused")}, {})
    campaign.fail(chunks[1], "worker_died", "gone")
    counts = campaign.write("jsonl")
    campaign.close()
    store.close()
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["id"], r["ok"], r.get("v"), r.get("reason")) for r in lines] == [
        ("r0", True, "a", None), ("r1", False, None, "request_failed"), ("r2", True, "a", None),
        ("r3", False, None, "worker_died"), ("r4", False, None, "request_failed"), ("r5", True, "a", None)]
    assert counts["ok"] == 3 and counts["failure_reasons"] == {"request_failed": 2, "worker_died": 1}
    assert campaign.counts["duplicates"] == 3 and campaign.counts["computed"] == 3
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_the_campaign_core_imports_nothing_of_prefect():
    import subprocess
    import sys

    code = ("import sys, resident_pool.campaigns.campaign, resident_pool.campaigns.inputs, resident_pool.campaigns.results; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


# -- review round 3 (issue 24): the output folder, held open ------------------------------------------------------
def test_an_output_folder_swapped_for_a_link_mid_run_is_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"  # where a link planted mid-run would send the output
    elsewhere.mkdir()
    output = tmp_path / "screened" / "result.jsonl"
    store, campaign = _campaign(tmp_path, output)
    assert campaign.add([Record(0, "a", "MKV", 1)]) == []
    (chunk,) = campaign.flush()
    campaign.finish(chunk, [{"x": 1}], {}, {})
    os.rename(tmp_path / "screened", tmp_path / "moved")
    (tmp_path / "screened").symlink_to(elsewhere)
    campaign.write("jsonl")
    campaign.close()
    store.close()
    assert list(elsewhere.iterdir()) == []
    assert [json.loads(line)["ok"] for line in (tmp_path / "moved" / "result.jsonl").read_text().splitlines()] == [
        True]


def test_an_output_folder_reached_through_another_users_folder_or_link_is_refused(tmp_path, other_user):
    import pwd

    info = pwd.getpwnam(other_user)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, info.pw_uid, info.pw_gid)
    store = ResultStore.for_provider("p", tmp_path / "store")
    with pytest.raises(InputError, match=f"owned by uid {info.pw_uid}"):
        Campaign(store, "v", {}, chunk_size=2, output=theirs / "result.jsonl")
    open_inbox = tmp_path / "inbox"
    open_inbox.mkdir()
    os.chmod(open_inbox, 0o777)  # anyone may rename "screened" away and plant a link in its place
    with pytest.raises(InputError, match=r"lies under .*inbox, writable by .*chmod \+t"):
        Campaign(store, "v", {}, chunk_size=2, output=open_inbox / "screened" / "result.jsonl")
    store.close()
    assert list(theirs.iterdir()) == [] and list(open_inbox.iterdir()) == []


def test_a_partial_journal_that_is_a_hard_link_is_refused_never_emptied(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("someone's file\n")
    os.link(victim, tmp_path / "result.jsonl.partial")  # a hard link in the output folder (another user's, once)
    store = ResultStore.for_provider("p", tmp_path / "store")
    with pytest.raises(InputError, match="is not a file of yours alone"):
        Campaign(store, "v", {}, chunk_size=2, output=tmp_path / "result.jsonl")
    store.close()
    assert victim.read_text() == "someone's file\n"


# -- speed (issue 27): task runs sized by the model's time, FASTA regions written again whole --------------------
def test_task_runs_start_at_one_request_and_grow_to_about_a_second_of_the_models_time():
    from resident_pool.campaigns.campaign import TaskSizer

    sizer = TaskSizer(chunk_size=64)
    assert sizer.size == 64  # nothing measured yet: one request
    sizer.observe(64, 0.064)  # 1 ms an input: 1,000 inputs a second, in whole requests
    assert sizer.size == 960
    for _ in range(10):  # far faster, run after run (each measure is averaged with the last): capped
        sizer.observe(960, 0.00096)
    assert sizer.size == TaskSizer.MAX_INPUTS // 64 * 64
    slow = TaskSizer(chunk_size=64)
    slow.observe(64, 30.0)  # a request already outlasts the target: one request a run
    assert slow.size == 64
    slow.observe(64, None)  # a run that failed says nothing
    assert slow.size == 64


def _fasta_records(path: Path, texts: list[str], bad: int | None = None) -> Path:
    path.write_text("".join(f">s{n} protein {n}\n{'!' if n == bad else ''}{text}\n" for n, text in enumerate(texts)))
    return path


def _screened(store: ResultStore, path: Path, output: Path, compute: list[int]) -> dict:
    """One campaign over a FASTA file as the flow runs it (Regions looked up whole), computing in this process."""
    from resident_pool.campaigns.inputs import InputFile, Region

    campaign = Campaign(store, "v", {}, chunk_size=100, output=output)

    def run(chunks):
        for chunk in chunks:
            compute.append(len(chunk))
            campaign.finish(chunk, [{"n": len(text)} for text in chunk.texts], {}, {})

    block = []
    for item in InputFile(path).records(regions=True):
        if isinstance(item, Region):
            run(campaign.add(block) + campaign.add_region(item))
            block = []
        else:
            block.append(item)
    run(campaign.add(block) + campaign.flush())
    written = campaign.write("jsonl")
    campaign.close()
    return {**written, **campaign.counts}


def test_a_fasta_screened_before_is_written_again_from_its_regions_not_input_by_input(tmp_path, monkeypatch):
    texts = [f"MKV{'ACDEFGHIKLMNPQRSTVWY'[n % 20] * (50 + n % 200)}{n}" for n in range(20_000)]
    texts = [text.translate(str.maketrans("0123456789", "ACDEFGHIKL")) for text in texts]
    path = _fasta_records(tmp_path / "in.fasta", texts)
    store = ResultStore.for_provider("p", tmp_path / "store")
    computed: list[int] = []
    first = _screened(store, path, tmp_path / "a.jsonl", computed)
    assert first["ok"] == 20_000 and sum(computed) == 20_000
    looked_up = []
    real = ResultStore.results
    monkeypatch.setattr(ResultStore, "results", lambda self, keys: looked_up.extend(keys) or real(self, keys))
    again = _screened(store, path, tmp_path / "b.jsonl", computed)
    assert again["ok"] == 20_000 and again["from_store"] == 20_000 and sum(computed) == 20_000
    assert len(looked_up) < 1_000, len(looked_up)  # the last stretch of the file, not every input
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    store.close()


def test_a_region_with_a_changed_or_bad_record_is_read_input_by_input_and_only_the_change_computed(tmp_path):
    texts = ["MKV" + "ACDEFGHIKLMNPQRSTVWY"[n % 20] * (100 + n % 50) + "ACDEFGHIKLMNPQRSTVWY"[n // 20 % 20] +
             "ACDEFGHIKLMNPQRSTVWY"[n // 400 % 20] + "ACDEFGHIKLMNPQRSTVWY"[n // 8000 % 20] for n in range(20_000)]
    path = _fasta_records(tmp_path / "in.fasta", texts, bad=5)
    store = ResultStore.for_provider("p", tmp_path / "store")
    computed: list[int] = []
    first = _screened(store, path, tmp_path / "a.jsonl", computed)
    assert (first["ok"], first["failed"]) == (19_999, 1)
    texts[10_000] = "MKVCHANGED"
    _fasta_records(path, texts, bad=5)
    computed.clear()
    again = _screened(store, path, tmp_path / "b.jsonl", computed)
    assert sum(computed) == 1 and (again["ok"], again["failed"]) == (19_999, 1)
    lines = (tmp_path / "b.jsonl").read_text().splitlines()
    assert json.loads(lines[5])["reason"] == "bad_input" and json.loads(lines[10_000])["n"] == len("MKVCHANGED")
    assert [json.loads(line)["index"] for line in lines] == list(range(20_000))
    store.close()


def test_the_output_is_written_while_later_inputs_are_still_computed(tmp_path):
    """Records go out in input order as soon as they and those before them have an outcome: what is held is what
    waits, not the whole input."""
    store, campaign = _campaign(tmp_path, tmp_path / "out.jsonl")
    first = campaign.add([Record(i, f"r{i}", f"T{i}", i + 1) for i in range(4)])
    assert [chunk.texts for chunk in first] == [["T0", "T1"], ["T2", "T3"]]
    campaign.finish(first[1], [{"v": 2}, {"v": 3}], {}, {})
    assert campaign.backlog == 4  # the first two still wait, so nothing is written
    campaign.finish(first[0], [{"v": 0}, {"v": 1}], {}, {})
    assert campaign.backlog == 0 and campaign.written["ok"] == 4
    campaign.write("jsonl")
    campaign.close()
    store.close()
    assert [json.loads(line)["v"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
