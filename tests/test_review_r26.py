"""Review r26 of issue 26 (the Prefect face): reproductions of defects found, each failing at the reviewed commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).with_name("resident-pool"))
ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None, env=None):
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=180, check=False, cwd=cwd, env=env)


def test_the_shipped_echo_provider_answers_through_the_console_script(isolated_dirs):
    """Any worker start fails at HEAD: Starter.run writes self.workers, an attribute Starter does not have."""
    done = _cli("predict", "echo", "--payload", '{"ping": "hello"}', "--manifests", str(ROOT / "manifests"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["echo"] == {"ping": "hello"}


def _letters(n: int) -> str:
    """A distinct protein-like word per number."""
    letters = "ACDEFGHIKLMNPQRSTVWY"
    return "".join(letters[n // 20 ** k % 20] for k in range(4))


def _screen_module():
    sys.path.insert(0, str(ROOT / "flows"))
    import screen

    return screen


class _Recorder:
    """What flows/screen.py's _Progress does with each update, without Prefect: the percentage it would show."""

    def __init__(self):
        from resident_pool.campaigns.progress import Progress

        self.tally = Progress()
        self.shown = []

    def update(self, entry, **counts):
        self.tally.update(entry, **counts)
        self.shown.append((self.tally.done, round(self.tally.percent(), 1)))


def _run_file(tmp_path, source, chunk_size=64, window=4):
    """One input file through screen's own _FileRun, each chunk answered by a thread: the percentages shown."""
    import concurrent.futures

    from resident_pool.campaigns.campaign import Campaign, CampaignSettings
    from resident_pool.campaigns.results import ResultStore

    screen = _screen_module()
    progress = _Recorder()
    entry = progress.tally.add_file(str(source.path), source.record_count(), source.size())
    progress.tally.begin(entry)
    store = ResultStore.for_provider("fake", tmp_path / "results")
    campaign = Campaign(store, "v1", {}, chunk_size, tmp_path / "out.jsonl")
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def submit(_task, params):
        def answer():
            import time

            time.sleep(0.002)
            return {"results": [{"n": len(t)} for t in params["texts"]], "failed": {}, "cold": False, "pid": 1,
                    "version": "v1", "latency_s": 0.0}
        return pool.submit(answer)

    run = screen._FileRun(source, campaign, entry, provider="fake", manifests=str(tmp_path), options={},
                          submit=submit, window=window, progress=progress,
                          limits=CampaignSettings(results_dir=tmp_path / "results"))
    run.run()
    campaign.close()
    store.close()
    pool.shutdown()
    return progress.shown


def test_a_gzip_inputs_progress_is_an_honest_estimate(tmp_path):
    """A .gz input is estimated from bytes_read(), which for a small .gz (under the gzip reader's 128 KiB read)
    is the whole compressed size from the first record on: the estimate is "inputs read so far", so a
    2,000-input file shows 75 % with 768 inputs (38 %) done, then stands still at 75 % until 1,500 are done."""
    import gzip

    from resident_pool.campaigns.inputs import InputFile

    path = tmp_path / "in.fasta.gz"
    with gzip.open(path, "wt") as out:
        out.write("".join(f">s{n}\nMKV{_letters(n)}ACDEFGHIKLMNPQRSTVWY\n" for n in range(2000)))
    shown = _run_file(tmp_path, InputFile(path))
    worst = max(shown, key=lambda pair: pair[1] - pair[0] / 20)
    assert worst[1] - worst[0] / 20 < 20, (f"{worst[0]} of 2,000 inputs done ({worst[0] / 20:.1f} %) was shown as "
                                          f"{worst[1]} %; every update: {shown}")


def test_the_outputs_artifact_takes_a_relative_output_as_make_run_gives_it():
    """`make run` passes `--output out/uniprot-500.fasta.minilm.jsonl`: the report's path is relative, and
    Path.as_uri() raises on it, so the flow fails after writing every output."""
    screen = _screen_module()
    total = {"provider": "minilm", "host": "vm", "files": [
        {"file": "data/uniprot-500.fasta", "output": "out/uniprot-500.fasta.minilm.jsonl", "inputs": 500, "ok": 500,
         "failed": 0, "report": "out/uniprot-500.fasta.minilm.jsonl.report.html"}]}
    assert "uniprot-500.fasta.minilm.jsonl.report.html" in screen._outputs(total)


def test_screen_py_with_a_relative_output_ends_completed(prefect_harness, pool_dir, tmp_path):
    """The command `make run` runs, with a fast provider and an output relative to the working folder."""
    from prefect.settings import PREFECT_API_URL
    from providers import EMBEDDER_ENV, write_provider

    write_provider(pool_dir, "embedder", EMBEDDER_ENV, worker="embedder.py")
    inputs = tmp_path / "in.fasta"
    inputs.write_text("".join(f">s{n}\nMKV{_letters(n)}\n" for n in range(20)))
    done = subprocess.run([sys.executable, str(ROOT / "flows" / "screen.py"), "--input", str(inputs), "--provider",
                           "embedder", "--manifests", str(pool_dir), "--output", "out/in.embedder.jsonl"],
                          cwd=tmp_path, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "in.embedder.jsonl").exists()
