"""resident_pool.validation.sanity: the [answers] checks that tell a working model from a degenerate one."""

from __future__ import annotations

import base64
import struct

from resident_pool.providers.manifest import Answers, Relation
from resident_pool.validation.sanity import judge, vectors

ANSWERS = Answers(embedding="embedding")


def _item(vector, tokens=10, unknown=0):
    return {"embedding": vector, "tokens": tokens, "unknown_tokens": unknown}


def test_distinct_inputs_sharing_one_answer_fail_naming_how_many_pairs_and_which():
    items = [_item([1.0, 0.0, 0.0]), _item([1.0, 0.0, 0.0]), _item([1.0, 0.00001, 0.0]), _item([0.0, 1.0, 0.0])]
    found = judge(ANSWERS, ["a", "b", "c", "d"], ["MKV", "MKA", "MKC", "MKD"], items)
    assert not found.ok
    assert found.figures["close_pairs"] == 3 and found.figures["pairs"] == 6
    (problem,) = found.problems
    assert "3 of 6 pairs of distinct inputs (50.0%) lie within cosine 0.9999 (at most 0 may)" in problem
    assert "a and b (1.000000)" in problem


def test_a_repeated_input_shares_its_answer_by_right_and_a_bound_admits_close_pairs():
    items = [_item([1.0, 0.0]), _item([1.0, 0.0]), _item([0.0, 1.0])]
    found = judge(ANSWERS, ["a", "a-again", "b"], ["MKV", "MKV", "MKA"], items)
    assert found.ok, found.problems
    assert found.figures["pairs"] == 2 and found.figures["distinct_inputs"] == 2
    close = judge(Answers(embedding="embedding", max_close_pairs=1), ["a", "b", "c"], ["MKV", "MKA", "MKC"],
                  [_item([1.0, 0.0]), _item([1.0, 0.0]), _item([0.0, 1.0])])
    assert close.ok and close.figures["close_pairs"] == 1


def test_the_unknown_token_share_is_judged_where_the_items_report_it():
    items = [_item([1.0, 0.0], tokens=3, unknown=1), _item([0.0, 1.0], tokens=7, unknown=0)]
    found = judge(Answers(embedding="embedding", max_unknown_share=0.05), ["a", "b"], ["X" * 200, "MKV"], items)
    (problem,) = found.problems
    assert "1 of 10 tokens (10.0%) are unknown tokens (at most 5% may be), in 1 of 2 inputs (a)" in problem
    unreported = judge(ANSWERS, ["a", "b"], ["MKV", "MKA"], [{"embedding": [1.0, 0.0]}, {"embedding": [0.0, 1.0]}])
    assert unreported.ok and "unknown tokens not reported" in unreported.said


def test_an_answer_with_nan_or_without_its_vector_fails_and_identical_answers_have_no_spread():
    nan = judge(ANSWERS, ["a", "b"], ["MKV", "MKA"], [_item([float("nan"), 1.0]), _item([0.0, 1.0])])
    assert nan.problems == ["1 answers hold NaN or an infinity (a)"]
    missing = judge(ANSWERS, ["a", "b"], ["MKV", "MKA"], [_item([1.0, 0.0]), {"tokens": 3}])
    assert missing.problems == ["1 of 2 answers hold no 'embedding' vector (b)"]
    flat = judge(Answers(embedding="embedding", checks=["spread"]), ["a", "b"], ["MKV", "MKA"],
                 [_item([0.5, 0.5]), _item([0.5, 0.5])])
    assert flat.problems and flat.problems[0].startswith("the answers do not vary: their spread")


def test_an_answer_all_zero_or_one_value_throughout_fails_finite_and_two_zero_answers_are_one_for_distinct():
    found = judge(ANSWERS, ["a", "b", "c"], ["MKV", "MKA", "MKC"],
                  [_item([0.0, 0.0, 0.0]), _item([0.2, 0.2, 0.2]), _item([0.0, 1.0, 0.0])])
    (problem,) = found.problems
    assert problem.startswith("2 of 3 answers carry no direction: a (all zero), b (0.2 throughout)")
    zeros = judge(Answers(embedding="embedding", checks=["distinct"]), ["a", "b", "c"], ["MKV", "MKA", "MKC"],
                  [_item([0.0, 0.0]), _item([0.0, 0.0]), _item([0.0, 1.0])])
    assert zeros.figures["close_pairs"] == 1 and "a and b (1.000000)" in zeros.problems[0]


def test_one_distinct_smoke_input_says_that_distinct_and_spread_compare_nothing():
    found = judge(ANSWERS, ["a"], ["MKV"], [_item([1.0, 0.0])])
    assert found.ok and "1 distinct smoke input: distinct and spread compare nothing" in found.describe()


def test_a_declared_relation_holds_fails_or_names_an_id_the_smoke_set_lacks():
    relation = Relation(anchor="parent", closer="mutant", farther="other", why="a point mutant stays near")
    answers = Answers(embedding="embedding", relations=[relation])
    ids, texts = ["parent", "mutant", "other"], ["MKVL", "MKVA", "WWWW"]
    held = judge(answers, ids, texts, [_item([1.0, 0.0]), _item([0.99999, 0.0001]), _item([0.0, 1.0])])
    assert held.ok, held.problems  # the mutant lies within 0.9999 of its parent: a relation, not a collision
    assert any(line.startswith("a point mutant stays near: mutant at cosine") for line in held.said)
    wrong = judge(answers, ids, texts, [_item([1.0, 0.0]), _item([0.0, 1.0]), _item([0.7, 0.7])])
    assert "mutant lies no closer to parent than other does" in wrong.describe()
    same = judge(answers, ids, texts, [_item([1.0, 0.0]), _item([1.0, 0.0]), _item([0.0, 1.0])])
    assert "mutant gets the same answer as parent" in same.describe()
    absent = judge(Answers(embedding="embedding", relations=[relation.model_copy(update={"farther": "nobody"})]),
                   ids, texts, [_item([1.0, 0.0]), _item([0.9, 0.1]), _item([0.0, 1.0])])
    assert "names nobody, which the smoke inputs do not hold" in absent.describe()


def test_vectors_are_read_as_lists_arrays_or_base64_float32_and_nothing_is_judged_without_a_declaration():
    encoded = base64.b64encode(struct.pack("<2f", 0.5, -1.0)).decode()
    assert vectors([{"embedding_f32": encoded}, {"embedding": [1, 2]}, {"embedding": "x"}, None], "embedding") == [
        [0.5, -1.0], [1.0, 2.0], None, None]
    assert judge(Answers(), ["a"], ["MKV"], [{"anything": 1}]).ok


def test_bench_answers_prints_the_figures_make_run_must_show_and_fails_a_degenerate_output(tmp_path, capsys):
    """bench/answers.py: the command behind the README's figures, on a file of three proteins (two alike)."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_answers", Path(__file__).parents[1] / "bench" / "answers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKV\n>b\nMKVLA\n>a2\nMKV\n")

    def output(vectors, unknown=0):
        path = tmp_path / "out.jsonl"
        path.write_text("".join(json.dumps({"index": n, "ok": True, "tokens": t, "windows": 1, "unknown_tokens": unknown,
                                            "embedding_f32": base64.b64encode(struct.pack("<2f", *v)).decode()}) + "\n"
                                for n, (v, t) in enumerate(zip(vectors, (3, 5, 3), strict=True))))
        return str(path)

    assert bench.main(["--input", str(fasta), "--output", output([(1, 0), (0, 1), (1, 0)])]) == 0
    said = capsys.readouterr().out
    assert "3 records" in said and "2 distinct sequences" in said and "distinct answers: 2 for the 2" in said
    assert "within cosine 0.9999: 0 of 1;" in said and "each shares its first occurrence's answer" in said
    assert "equal to the sequence length for 3 of 3" in said and "unknown tokens: 0 in all" in said
    assert bench.main(["--input", str(fasta), "--output", output([(1, 0), (1, 0), (1, 0)], unknown=1)]) == 1
    said = capsys.readouterr().out
    assert "distinct answers: 1 for the 2" in said and "within cosine 0.9999: 1 of 1;" in said
