from __future__ import annotations

import pickle

from resident_pool import EXIT_HINTS, WorkerRequestError, WorkerStartError, exit_hint
from resident_pool.errors import error_from_dict
from resident_pool.exits import describe_exit


def test_the_stable_codes_have_words():
    assert exit_hint(0) == "clean exit"
    assert "usage" in exit_hint(2)
    assert "refus" in exit_hint(3)
    assert "accelerator" in exit_hint(5) and "KERNELS" in exit_hint(5)
    assert set(EXIT_HINTS) >= {0, 2, 3, 5}


def test_signal_deaths_are_named_with_their_likely_cause():
    assert exit_hint(-9).startswith("killed by SIGKILL") and "OOM" in exit_hint(-9)
    assert "native code" in exit_hint(-11) and "SIGSEGV" in exit_hint(-11)
    assert "native code" in exit_hint(-6) and "SIGABRT" in exit_hint(-6)


def test_a_code_without_an_entry_is_shown_bare():
    assert exit_hint(42) is None
    assert describe_exit(42) == "exit code 42"
    assert describe_exit(3).startswith("exit code 3 (refusal")


def test_errors_pickle_and_cross_as_data_with_their_attributes():
    error = WorkerRequestError("echo: died", slug="echo", reason="worker_died", exit_code=-9,
                               transcript="/logs/echo.log", transcript_tail=["boom"])
    for copy in (pickle.loads(pickle.dumps(error)), error_from_dict(error.to_dict())):
        assert type(copy) is WorkerRequestError
        assert (copy.slug, copy.reason, copy.exit_code, copy.transcript) == ("echo", "worker_died", -9, "/logs/echo.log")
        assert copy.hint == exit_hint(-9)
        assert copy.transcript_tail == ["boom"]
        assert str(copy) == "echo: died"
    assert isinstance(error_from_dict({"type": "WorkerStartError", "error": "x"}), WorkerStartError)
