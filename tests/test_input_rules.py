"""resident_pool.providers.input_rules: one rule for what one input may be, whichever entry point it comes through."""

from __future__ import annotations

import pytest

from resident_pool.campaigns.answers import with_refused
from resident_pool.campaigns.campaign import Campaign
from resident_pool.campaigns.inputs import Record
from resident_pool.campaigns.results import ResultStore
from resident_pool.providers.input_rules import Inputs, ProteinPolicy, kind_option, rule_inputs

PROTEIN = Inputs(kinds=["protein"])
BOTH = Inputs(kinds=["protein", "text"], protein=ProteinPolicy(X="accept", B="accept", Z="accept", U="accept",
                                                               O="accept", **{"*": "trailing"}))


@pytest.mark.parametrize(("given", "sent"), [
    ("MKVLAAGIV", "MKVLAAGIV"),
    ("mkv laa\ngiv", "MKVLAAGIV"),  # read as FASTA's sequences are: whitespace dropped, upper case
    ("MKVX", "MKVX"),  # X, an unknown residue, passes by default
    ("MKV*", "MKV"),  # one final stop is dropped
    ("MKV* ", "MKV"),
])
def test_a_protein_the_default_policy_takes_is_sent_as_fasta_would_read_it(given, sent):
    assert PROTEIN.check(given, "protein") == (sent, None)


@pytest.mark.parametrize(("given", "words"), [
    ("MK1V", "position 3 holds '1', which is not a residue letter"),
    ("MK-V", "position 3 is a gap (-); give the sequence without its alignment gaps"),
    ("MK.V", "position 3 is a gap (.)"),
    ("MK*V", "position 3 is a stop (*) before the end, which this provider refuses"),
    ("MKV**", "position 4 is a stop (*) before the end"),
    ("MKUV", "position 3 is U, selenocysteine, which this provider refuses"),
    ("MKBV", "position 3 is B, Asx (D or N)"),
    ("MKJV", "position 3 holds 'J', which is not a residue letter"),
    ("MKVé", "character 4 is U+00E9, which is not a residue letter"),
    ("MK\x1bV", "position 3 holds U+001B"),
    ("   ", "empty: it holds no residue letters"),
    ("*", "empty: it holds no residue letters"),
    (5, "a number, not text"),
    (None, "null, not text"),
    (["MKV"], "a list, not text"),
])
def test_a_protein_the_rule_refuses_is_named_by_position_and_what_it_holds_never_quoted_whole(given, words):
    text, problem = PROTEIN.check(given, "protein")
    assert text == "" and words in problem, problem
    assert "takes the 20 standard residues, X; a final * dropped" in problem or "gap" in problem or \
        "empty" in problem or "not text" in problem or "character" in problem


def test_a_policy_can_accept_refuse_or_replace_each_letter_and_the_stop():
    replaced = Inputs(kinds=["protein"], protein=ProteinPolicy(U="C", O="K", X="refuse", **{"*": "accept"}))
    assert replaced.check("MUOV*", "protein") == ("MCKV*", None)
    assert replaced.check("MXV", "protein")[1].startswith("position 2 is X, an unknown residue, which this provider "
                                                         "refuses; it takes the 20 standard residues, U (read as C), "
                                                         "O (read as K); * passed on")
    strict = Inputs(kinds=["protein"], protein=ProteinPolicy(**{"*": "refuse"}))
    assert "position 4 is a stop (*)," in strict.check("MKV*", "protein")[1]
    assert BOTH.check("MKVXBZUO*", "protein") == ("MKVXBZUO", None)


def test_text_is_anything_but_blank_and_a_kind_the_provider_lacks_falls_back_to_its_first():
    assert BOTH.check("  a sentence, with 1 digit  ", "text") == ("a sentence, with 1 digit", None)
    assert BOTH.check(" \n ", "text") == ("", "empty: it holds no text")
    invisible = BOTH.check(" \u200b\ufeff\u00ad\x00\u200b ", "text")
    assert invisible == ("", "empty: it holds no visible text, only invisible characters (U+200B, U+FEFF, U+00AD)")
    assert BOTH.check("\u200bhello\u00ad", "text") == ("\u200bhello\u00ad", None)  # a visible letter: read
    assert BOTH.kind_for("text") == "text" and BOTH.kind_for(None) == "protein"
    assert PROTEIN.kind_for("text") == "protein"  # a protein-only provider reads a text column as proteins
    assert Inputs().kind_for("protein") == "text"  # a provider that declares nothing takes free text
    assert kind_option(BOTH, "text") == {"kind": "text"} and kind_option(PROTEIN, "protein") == {}


def test_inputs_given_by_hand_are_ruled_each_alone_and_the_refused_ones_keep_their_place_among_the_answers():
    texts, kept, refused = rule_inputs(PROTEIN, ["MKV", "", "MK1", "mka*"], "protein")
    assert texts == ["MKV", "MKA"] and kept == [0, 3]
    assert refused == {1: "input 2 of 4: empty: it holds no residue letters",
                       2: refused[2]} and refused[2].startswith("input 3 of 4: position 3 holds '1'")
    items = with_refused([{"v": 1}, {"v": 2}], kept, refused, 4)
    assert items[0] == {"v": 1} and items[3] == {"v": 2}
    assert items[1] == {"ok": False, "reason": "bad_input", "error": refused[1]}


def test_a_campaign_fails_each_input_its_rule_refuses_alone_and_sends_the_others_as_ruled(tmp_path):
    """The screen flow's readers hand every record to the campaign, which applies the provider's rule: a bad
    record fails alone with the reason the rule gives, and a good one is sent (and keyed) as the rule reads it."""
    def rule(record: Record):
        text, problem = PROTEIN.check(record.text, "protein")
        return text, None if problem is None else f"in.fasta:{record.line}: {record.id}: {problem}"

    with ResultStore.for_provider("model", tmp_path / "store") as store:
        campaign = Campaign(store, "v1", {}, 10, tmp_path / "out.jsonl", rule=rule)
        try:
            chunks = campaign.add([Record(0, "a", "MKV*", 1), Record(1, "b", "MK*V", 3), Record(2, "c", "MKV", 5),
                                   Record(3, "d", "", 7, "in.fasta:7: empty sequence")])
            (chunk,) = chunks or campaign.flush()
            assert chunk.texts == ["MKV"] and chunk.ids == ["a"]  # "MKV*" is "MKV": c repeats a and is not sent
            campaign.finish(chunk, [{"length": 3}], {}, {})
            campaign.write()
        finally:
            campaign.close()
    records = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [('"ok":true' in line) for line in records] == [True, False, True, False]
    assert '"error":"in.fasta:3: b: position 3 is a stop (*) before the end' in records[1]
    assert '"reason":"bad_input"' in records[1] and '"error":"in.fasta:7: empty sequence"' in records[3]
