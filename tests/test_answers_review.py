"""Review 33 (red team): probes of issue 33 (answers that mean something), each small and quick.

A probe that fails here shows a defect on the current code: a degenerate model that the [answers] checks bless.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from helpers import load_minilm_worker

from resident_pool.providers.manifest import Answers, load_manifest
from resident_pool.validation import expected
from resident_pool.validation.sanity import judge

ROOT = Path(__file__).resolve().parents[1]
MINILM = ROOT / "manifests" / "minilm"


def _random_unit(rng: random.Random, dim: int = 384) -> list[float]:
    vector = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


def test_r33_answers_that_are_all_zero_for_most_inputs_fail_the_answers_checks():
    """A classic degenerate output (an all-masked mean pool, a model that returns zeros past some length): 28 of
    32 distinct inputs get the zero vector. They are one answer, as alike as can be; the distinct check must count
    them (a zero vector has no direction: cosine 0 to everything, so it is never "close"), or a zero-norm answer
    must fail on its own. Today the verdict is ok: '0 of 496 pairs of distinct inputs within cosine 0.9999'."""
    rng = random.Random(33)
    ids = [f"p{n}" for n in range(32)]
    texts = ["M" + "ACDEFGHIKLMNPQRSTVWY"[n % 20] * (50 + n) for n in range(32)]
    items = [{"embedding": _random_unit(rng) if n < 4 else [0.0] * 384, "tokens": len(texts[n]),
              "unknown_tokens": 0} for n in range(32)]
    found = judge(Answers(embedding="embedding"), ids, texts, items)
    assert not found.ok, f"28 of 32 answers are the zero vector, yet the checks pass: {found.describe()}"


@pytest.fixture(scope="module")
def minilm():
    """The demo's worker module, its model loaded in this process, and its manifest."""
    pytest.importorskip("sentence_transformers")
    worker = load_minilm_worker("r33_minilm_worker")
    manifest = load_manifest(MINILM / "manifest.toml")
    return worker, worker.load(_weights(manifest)), manifest


@pytest.mark.slow
def test_r33_a_minilm_that_reads_only_its_first_window_fails_the_smoke_answers_checks(minilm):
    """Issue 33, item 1: "a demo whose answer depends on the whole input". The regression that matters next to
    the old [UNK] one is silent truncation: the model reads the first 254 residues and drops the rest. The shipped
    smoke set holds 15 proteins longer than one window, but its only relation (RECO_PORGI, 245 residues, mutant
    F122P) lies inside the first window, so a truncating minilm passes every [answers] check (and `check --bless`
    would bless it). The checks must fail it."""
    worker, model, manifest = minilm
    smoke = expected.smoke_set(manifest)
    assert sum(len(text) > worker.WINDOW for text in smoke.texts) >= 10  # the set does reach past one window
    truncated = [text[:worker.WINDOW] for text in smoke.texts]
    vectors, items = worker.embed(model, truncated)
    for item, text in zip(items, smoke.texts, strict=True):
        item["tokens"] = len(text)  # what a truncating worker that reports its input's length says
        item["windows"] = len(worker.windows(len(text)))
    answers = [{**item, "embedding": [float(x) for x in vector]} for item, vector in zip(items, vectors, strict=True)]
    found = judge(manifest.answers, smoke.ids, smoke.texts, answers)
    assert not found.ok, f"a minilm that drops every residue past {worker.WINDOW} passes: {found.describe()}"


def _weights(manifest) -> str:
    from resident_pool.providers.launch import weights_root

    return str(weights_root(manifest))


def test_r33_check_with_its_defaults_says_it_did_not_judge_a_degenerate_models_answers(tmp_path):
    """Issue 33, item 2: "`resident-pool check` (and the validate flow, the CI workflow) adds answer-sanity
    checks". Run as a scientist runs it, with no flag, on the old demo (tests/workers/minilm_whole_word.py, most
    proteins one [UNK]), `check` prints "0 failed, 5 passed" exactly as it did before the issue, and nothing says
    that the answers were not judged. Either it judges them (and fails), or its output names the answers step as
    not run ("run with --smoke")."""
    import json
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "minilm-whole-word"
    shutil.copytree(MINILM, folder)
    manifest = folder / "manifest.toml"
    manifest.write_text(manifest.read_text().replace('slug = "minilm"', 'slug = "minilm-whole-word"'))
    shutil.copy(Path(__file__).resolve().parent / "workers" / "minilm_whole_word.py", folder / "worker.py")
    done = subprocess.run([sys.executable, "-m", "resident_pool", "check", "--json", "--manifests", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    rows = json.loads(done.stdout)
    steps = [row["step"] for row in rows]
    assert done.returncode != 0 or "answers" in steps, (
        f"check passed a degenerate model without a word about its answers: steps {steps}, rc {done.returncode}")


def test_r33_predict_help_names_the_inputs_table_it_rules_by():
    """Cosmetic: `resident-pool predict --help` reads "(the provider's ): one it refuses fails alone": rich markup
    swallowed "[inputs]" from the docstring, so the help never says which manifest table rules the inputs."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "resident_pool", "predict", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False, env={**__import__("os").environ,
                                                                                         "COLUMNS": "300"})
    assert "(the provider's [inputs])" in done.stdout, done.stdout


@pytest.mark.parametrize("invisible", ["\u200b", "\ufeff", "\u00ad", "\x00"],
                         ids=["zero-width-space", "bom", "soft-hyphen", "nul"])
def test_r33_a_text_the_rule_passes_is_one_the_minilm_worker_can_read(invisible):
    """Issue 33, item 3: "a bad item fails that item alone ... and the others get their answers". The text rule
    passes anything str.strip() leaves (a zero-width space, a BOM, a soft hyphen, NUL), but minilm's tokenizer reads
    no token in them and the worker refuses the whole request ("ValueError: input 2 holds no text"). Reproduced:
    `resident-pool predict minilm --payload '{"kind":"text","inputs":["hello world","\\u200b","good morning"]}'`
    exits 1 with WorkerRequestError and no answer for the two good inputs. The rule must refuse what the worker
    cannot read (or the worker must answer it)."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    manifest = load_manifest(MINILM / "manifest.toml")
    text, problem = manifest.inputs.check(f"  {invisible} ", "text")
    if problem is not None:
        return  # refused by the rule, named: what the issue asks
    tokenizer = AutoTokenizer.from_pretrained(_weights(manifest))
    ids, _ = load_minilm_worker("r33_minilm_worker").token_ids(tokenizer, ["hello world", text, "good morning"], "text")
    assert all(ids)


def test_r33_the_map_notes_answers_that_coincide_within_the_distinct_tolerance_not_only_byte_for_byte(tmp_path):
    """Issue 33, item 6: "a note when many answers coincide". The map groups answers that are equal as float16
    bytes, so 30 of 40 answers that lie within cosine 0.99998 of one another (one dot to the eye; a degenerate
    model with a little noise, which [answers] distinct_cosine 0.9999 counts as one answer) draw 40 dots and no
    note. The note should use the same tolerance as the checks."""
    import json

    from resident_pool.campaigns.report import VectorSample, write_report

    rng = random.Random(6)
    base = _random_unit(rng, 64)
    sample = VectorSample()
    for n in range(40):
        vector = [x + rng.gauss(0.0, 3e-4) for x in base] if n < 30 else _random_unit(rng, 64)
        sample.offer(f"p{n}", json.dumps({"embedding": vector}))
    page = write_report(tmp_path / "r.html", title="t", summary={}, timeline=[], sample=sample,
                        failures=[]).read_text()
    assert "coincide" in page, "30 of 40 answers within cosine 0.99998 of each other: the map says nothing"


def test_r33_one_input_that_outruns_the_request_timeout_fails_alone_not_its_whole_chunk():
    """Issue 33, item 3: "a bad item fails that item alone ... and the others get their answers". The rule puts
    no bound on a protein's length (the reader's is 1 MiB), and minilm now reads every residue: 787 windows for
    100,001 residues (375 s on this shared 2-core machine, load ~20). A chunk whose one input outruns
    request_timeout_s is never split: predict_chunk isolates inputs only for "request_failed", so the timeout is
    retried 3 times (a worker killed and restarted each time) and then every input of the chunk fails.
    Reproduced end to end: a minilm copy with request_timeout_s = 15 and a FASTA of 10 shipped proteins plus one
    of 30,000 residues: `flows/screen.py` ended "0 ok, 11 failed", all request_timeout, after 4 tries.
    Here: the screen flow's request step, with a session whose model times out on the long input only."""
    import sys

    sys.path.insert(0, str(ROOT / "flows"))
    from screen import _request

    from resident_pool.errors import RequestTimeout

    long = "A" * 100_001

    class Session:
        def predict(self, payload):
            if long in payload["inputs"]:
                raise RequestTimeout("minilm: a request outran request_timeout_s = 600 s")
            return {"items": [{"embedding": [float(len(text)), 1.0], "tokens": len(text)}
                              for text in payload["inputs"]]}

    failed: dict[int, tuple[str, str]] = {}
    try:
        results = _request(Session(), {}, ["MKV", long, "MKVLA"], 0, failed)
    except RequestTimeout as error:
        pytest.fail(f"one over-long input failed its whole chunk: {error}")
    assert results[0] is not None and results[2] is not None and set(failed) == {1}


@pytest.mark.slow
def test_r33_a_negative_batch_size_is_refused_not_answered_with_zero_vectors(minilm):
    """A hostile or mistaken request option: {"inputs": [...], "batch_size": -1} (the predict flow and
    `resident-pool predict` pass a payload's other keys through). embed's batch loop is range(0, n, -1), empty, so
    every input is answered "ok" with the zero vector (tokens, windows and unknown_tokens reported as if read);
    batch_size 0 at least raises. Expected: the request is refused, or the inputs read."""
    worker, model, _ = minilm
    try:
        vectors, _items = worker.embed(model, ["MKVLA", "WWWWW"], batch_size=-1)
    except ValueError:
        return
    assert all(any(abs(float(x)) > 0 for x in vector) for vector in vectors), "answered with zero vectors"


def test_a_chunk_whose_request_timed_out_holds_a_worker_again_for_its_other_inputs():
    """The real session ends with a timeout (the pool replaces that worker): the chunk's hold opens a new one for
    the inputs still to go, and an error it does not isolate still goes out through the session that raised it."""
    import contextlib
    import sys

    sys.path.insert(0, str(ROOT / "flows"))
    from screen import _Held, _request

    from resident_pool.errors import RequestTimeout, WorkerRequestError

    opened: list[str] = []
    closed: list[tuple[str, object]] = []

    class Session:
        def __init__(self, name):
            self.name, self.ended = name, False

        def predict(self, payload):
            if self.ended:
                raise WorkerRequestError("this session has ended; open a new one", reason="session_ended")
            if any(len(text) > 10 for text in payload["inputs"]):
                self.ended = True
                raise RequestTimeout("a request outran request_timeout_s")
            if "RAISE" in payload["inputs"]:
                raise WorkerRequestError("the pool is stopping", reason="pool_stopping")
            return {"items": [{"n": len(text)} for text in payload["inputs"]]}

    @contextlib.contextmanager
    def open_session():
        session = Session(f"s{len(opened)}")
        opened.append(session.name)
        try:
            yield session
        except BaseException as error:
            closed.append((session.name, type(error).__name__))
            raise
        closed.append((session.name, None))

    failed: dict[int, tuple[str, str]] = {}
    with _Held(open_session) as held:
        results = _request(held, {}, ["MKV", "A" * 20, "MKVLA", "W" * 30, "MK"], 0, failed)
    assert [None if item is None else item["n"] for item in results] == [3, None, 5, None, 2]
    assert {at: reason for at, (reason, _) in failed.items()} == {1: "request_timeout", 3: "request_timeout"}
    assert opened == ["s0", "s1", "s2", "s3"] and all(error is None for _, error in closed)
    with pytest.raises(WorkerRequestError, match="stopping"), _Held(open_session) as held:
        _request(held, {}, ["MKV", "RAISE"], 0, {})
    assert closed[-1] == ("s4", "WorkerRequestError")


def test_a_model_that_hangs_on_every_input_costs_a_chunk_two_timeouts_not_one_per_input():
    """The chunk that timed out goes again one input at a time (above); when its model hangs on everything, two
    single inputs in a row outrunning the timeout end the chunk: the rest are recorded as not sent, each with why,
    rather than costing request_timeout_s and a worker each (a chunk of 64 at 600 s would take over ten hours)."""
    import sys

    sys.path.insert(0, str(ROOT / "flows"))
    from screen import _request

    from resident_pool.errors import RequestTimeout

    sent: list[list[str]] = []

    class Hung:
        def predict(self, payload):
            sent.append(payload["inputs"])
            raise RequestTimeout("minilm: a request outran request_timeout_s = 600 s")

    failed: dict[int, tuple[str, str]] = {}
    texts = [f"MKV{n}" for n in range(64)]
    results = _request(Hung(), {}, texts, 100, failed)
    assert results == [None] * 64 and sorted(failed) == list(range(100, 164))
    assert len(sent) == 3, sent  # the chunk, then two singles
    assert all(reason == "request_timeout" for reason, _ in failed.values())
    assert "not sent" in failed[163][1] and "not sent" not in failed[101][1]
