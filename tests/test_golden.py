"""The golden comparison: field by field, within tolerances, naming what differs."""

from __future__ import annotations

import base64
import math
import random
import struct
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resident_pool.validation.golden import EXACT, Tolerance, compare, decode_f32, format_path, normalize, summary

LOOSE = Tolerance(atol=1e-4, rtol=1e-3)


def f32(values):
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def test_an_identical_answer_has_no_mismatch():
    answer = {"items": [{"embedding": [0.1, -0.2, 0.3], "tokens": 7, "truncated": False}], "dim": 3, "note": None}
    assert compare(answer, answer, EXACT) == []


def test_numbers_within_tolerance_pass_and_beyond_it_are_named_with_the_deviation():
    assert compare({"x": 1.0}, {"x": 1.0005}, LOOSE) == []
    (miss,) = compare({"x": 1.0}, {"x": 1.01}, LOOSE)
    assert miss.path == "x" and miss.expected == 1.0 and miss.found == 1.01
    assert miss.deviation == pytest.approx(0.01)
    assert miss.why == "beyond the tolerance"
    assert LOOSE.describe() == "atol 0.0001 + rtol 0.001 x |expected|"
    (diff,) = compare({"x": 1.0}, {"x": 1.0005}, EXACT)
    assert diff.why == "differs" and EXACT.describe() == "exactly"


def test_one_perturbed_element_of_a_vector_names_its_index_and_the_worst_deviation():
    expected = {"items": [{"embedding": [0.05] * 384}]}
    found = {"items": [{"embedding": [0.05] * 384}]}
    found["items"][0]["embedding"][17] = 0.06
    found["items"][0]["embedding"][200] = 0.0502
    (miss,) = compare(expected, found, LOOSE)
    assert miss.path == "items[0].embedding[17]"
    assert miss.deviation == pytest.approx(0.01)
    assert miss.why == "2 of 384 numbers beyond the tolerance; the worst is this one"
    text = miss.describe()
    assert "items[0].embedding[17]" in text and "expected 0.05, found 0.06" in text and "deviation 0.01" in text


def test_a_tolerance_that_admits_the_perturbation_passes():
    expected, found = [0.05] * 384, [0.05] * 384
    found[17] += 1e-2
    assert compare(expected, found, LOOSE)
    assert compare(expected, found, Tolerance(atol=0.011)) == []


def test_the_cosine_floor_catches_a_vector_that_each_element_forgives():
    expected = [1.0, 0.0, 0.0, 0.0]
    found = [0.9, 0.3, 0.3, 0.0]
    assert compare(expected, found, Tolerance(atol=0.5)) == []
    (miss,) = compare(expected, found, Tolerance(atol=0.5, cosine_min=0.99))
    assert "cosine similarity 0.90" in miss.why and miss.path == ""


def test_strings_booleans_and_null_compare_exactly():
    assert [m.path for m in compare({"a": "x", "b": True, "c": None}, {"a": "y", "b": False, "c": 0}, LOOSE)] \
        == ["a", "b", "c"]
    (miss,) = compare({"c": None}, {"c": 0}, LOOSE)
    assert "null expected, a number found" in miss.why


def test_a_boolean_is_not_a_number():
    (miss,) = compare({"flag": True}, {"flag": 1}, LOOSE)
    assert "a boolean expected" in miss.why


def test_missing_and_unexpected_fields_and_lengths_are_named():
    mismatches = compare({"a": 1, "items": [1, "x"]}, {"b": 2, "items": [1]}, EXACT)
    text = summary(mismatches)
    assert "a: missing from the answer" in text
    assert "b: not in the expected answer" in text
    assert "items: 2 items expected, 1 found" in text


def test_ignored_fields_are_not_compared_at_any_depth_or_by_full_path():
    tolerance = Tolerance(ignore=("pid", "elapsed*", "items[*].tokens"))
    expected = {"pid": 1, "elapsed_s": 0.1, "items": [{"tokens": 3, "v": 1}], "nested": {"pid": 5}}
    found = {"pid": 2, "elapsed_ms": 9, "items": [{"tokens": 4, "v": 1}], "nested": {"pid": 6}}
    assert compare(expected, found, tolerance) == []
    assert normalize(found, tolerance) == {"items": [{"v": 1}], "nested": {}}
    assert compare({"tokens": 1}, {"tokens": 2}, tolerance)  # a full path does not match at other depths


def test_float32_base64_is_decoded_on_either_side():
    tolerance = Tolerance(atol=1e-6, float32_base64=("*_f32",))
    values = [0.1, -0.25, 3.5]
    assert decode_f32(f32(values)) == [pytest.approx(v, rel=1e-7) for v in values]
    assert compare({"embedding_f32": f32(values)}, {"embedding_f32": f32(values)}, tolerance) == []
    assert compare({"embedding_f32": decode_f32(f32(values))}, {"embedding_f32": f32(values)}, tolerance) == []
    (miss,) = compare({"embedding_f32": values}, {"embedding_f32": f32([0.1, -0.25, 3.6])}, tolerance)
    assert miss.path == "embedding_f32[2]" and miss.deviation == pytest.approx(0.1, rel=1e-5)


def test_a_field_that_is_not_float32_base64_is_named_not_raised():
    tolerance = Tolerance(float32_base64=("*_f32",))
    for bad in ("not base64!", base64.b64encode(b"abc").decode()):
        (miss,) = compare({"v_f32": [1.0]}, {"v_f32": bad}, tolerance)
        assert miss.why == "is not float32 base64"
    with pytest.raises(ValueError, match="whole number of float32"):
        decode_f32(base64.b64encode(b"abcde").decode())


def test_nan_and_infinity():
    assert compare([math.nan, math.inf], [math.nan, math.inf], EXACT) == []
    (miss,) = compare([0.0, 1.0], [math.nan, 1.5], EXACT)
    assert miss.path == "[0]" and math.isnan(miss.deviation)
    assert miss.to_dict()["deviation"] is None  # JSON has no NaN


def test_deep_nesting_is_reported_not_a_recursion_error():
    deep_a, deep_b = 1, 2
    for _ in range(5000):
        deep_a, deep_b = [deep_a], [deep_b]
    (miss,) = compare(deep_a, deep_b, EXACT)
    assert "nested deeper" in miss.why


def test_paths_quote_keys_that_would_read_ambiguously():
    assert format_path(("items", 0, "embedding", 17)) == "items[0].embedding[17]"
    assert format_path(("a.b", 1)) == '["a.b"][1]'
    (miss,) = compare({"weird key": 1}, {"weird key": 2}, EXACT)
    assert miss.path == '["weird key"]'


def test_the_summary_counts_what_it_does_not_spell_out():
    mismatches = compare({str(i): i for i in range(12)}, {str(i): i + 1 for i in range(12)}, EXACT)
    assert len(mismatches) == 12 and summary(mismatches).endswith("... and 7 more")


JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, width=32) | st.integers(-10**6, 10**6) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)


@given(JSON)
def test_any_answer_matches_itself_exactly(value):
    assert compare(value, value, EXACT) == []


@given(JSON, JSON)
def test_compare_never_raises_and_finds_no_difference_only_between_equal_values(a, b):
    if not compare(a, b, EXACT):
        assert a == b


def test_a_property_test_holds_while_another_thread_draws_from_the_random_module():
    """Prefect's background threads draw from `random` (event delivery's jitter) in a test process that ran a
    flow earlier; Hypothesis, seeing the module's state move while it drew an example, failed the property test
    above as flaky in a full run. The warning is ignored for that reason (pyproject.toml's filterwarnings)."""
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            random.random()

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        test_any_answer_matches_itself_exactly()
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_property_tests_here_judge_answers_not_time():
    """The suite's Hypothesis profile (conftest.py): no deadline, no too-slow health check, whatever the machine."""
    from hypothesis import HealthCheck, settings

    assert settings.default.deadline is None and HealthCheck.too_slow in settings.default.suppress_health_check
