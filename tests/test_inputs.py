"""resident_pool.campaigns.inputs: lazy readers for FASTA, CSV, TSV and JSONL (each optionally .gz), bad records alone."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import tracemalloc

import pytest

from resident_pool.campaigns import inputs
from resident_pool.campaigns.inputs import InputFile
from resident_pool.errors import InputError


def _records(path, **options):
    source = InputFile(path, **options)
    source.check()
    return list(source.records())


def _reference_fasta(text: str) -> list[tuple[str, str, int]]:
    """A plain line-by-line reading of well-formed FASTA: (id, sequence, header line)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(">"):
            found.append([line[1:].split()[0], "", number])
        elif found:
            found[-1][1] += line.strip().upper()
    return [tuple(record) for record in found]


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 20])
def test_fasta_read_in_blocks_of_any_size_matches_a_line_by_line_reading(tmp_path, monkeypatch, block):
    monkeypatch.setattr(inputs, "FASTA_BLOCK", block)
    rng = random.Random(block)
    lines = ["", "  "]  # blank lines before the first header are not a record
    for n in range(200):
        lines.append(f">p{n} some description {n}")
        sequence = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWYacd") for _ in range(rng.randint(1, 300)))
        lines += [sequence[i:i + 60] for i in range(0, len(sequence), 60)] + ([""] if n % 7 == 0 else [])
    text = "\r\n".join(lines) + "\n" if block == 7 else "\n".join(lines)
    path = tmp_path / "seqs.fasta"
    path.write_text(text)
    records = _records(path)
    assert [(r.id, r.text, r.line) for r in records] == _reference_fasta(text.replace("\r", ""))
    assert [r.index for r in records] == list(range(200)) and all(r.error is None for r in records)


@pytest.mark.parametrize("block", [5, 1 << 20])
def test_a_fasta_record_over_the_limit_is_skipped_without_being_held(tmp_path, monkeypatch, block):
    monkeypatch.setattr(inputs, "FASTA_BLOCK", block)
    path = tmp_path / "big.fasta"
    path.write_bytes(b">a\nMKV\n>huge\n" + (b"A" * 59 + b"\n") * 20 + b">b\nMK\n>tail\n" + b"C" * 2000)
    records = _records(path, max_record_bytes=1000)
    assert [(r.id, r.text, r.line) for r in records] == [("a", "MKV", 1), ("huge", "", 3), ("b", "MK", 24),
                                                         ("tail", "", 26)]
    assert "over the 1000-byte limit" in records[1].error and records[1].error.startswith(f"{path}:3: ")
    assert "RESIDENT_POOL_MAX_RECORD_BYTES" in records[3].error


def test_a_record_of_gigabytes_costs_no_more_memory_than_the_limit(tmp_path):
    path = tmp_path / "huge.fasta"
    with open(path, "wb") as out:
        out.write(b">huge\n")
        block = b"ACDEFGHIKL" * 100_000 + b"\n"
        for _ in range(60):  # 60 MB of one record
            out.write(block)
        out.write(b">after\nMKV\n")
    tracemalloc.start()
    try:
        records = list(InputFile(path, max_record_bytes=1 << 20).records())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.id for r in records] == ["huge", "after"] and records[1].text == "MKV"
    assert peak < 12 * (1 << 20)  # a few blocks and the limit, never the record


def test_fasta_bad_records_name_their_line_and_the_rest_is_read(tmp_path):
    path = tmp_path / "mixed.fa"
    path.write_bytes(b"MKV junk before any header\n>ok1\nMKV\n>bad\xff\nMKV\n>star\nMK*V-\n>nul\nMK\x00V\n>empty\n>ok2\nmk\n"
                     b">digit\nMKV\nMK1V\n")
    records = _records(path)
    assert [r.id for r in records] == ["line-1", "ok1", "line-4", "star", "nul", "empty", "ok2", "digit"]
    assert [r.text for r in records if r.error is None] == ["MKV", "MK*V-", "MK"]
    errors = {r.line: r.error for r in records if r.error}
    assert "before the first '>' header" in errors[1]
    assert "header is not UTF-8 text (byte 5)" in errors[4]
    # Issue 33: said as a person reads it, never as Python's bytes (screen said "line 1202 holds b'1'").
    assert "line 9 holds U+0000, which is not a sequence letter" in errors[8]
    assert "line 15 holds '1', which is not a sequence letter" in errors[13]
    assert "empty sequence" in errors[10]
    assert InputFile(path).kind == "protein"


@pytest.mark.parametrize(("name", "content", "kind"), [
    ("in.csv", "id,Sequence\na,MKV\n", "protein"),
    ("in.csv", "id,text\na,some words\n", "text"),
    ("in.tsv", "id\tseq\na\tMKV\n", "protein"),
    ("in.jsonl", '{"id": "a", "input": "words"}\n', "text"),
    ("in.jsonl", '{"id": "a", "sequence": "MKV"}\n{"id": "b", "text": "words"}\n', "protein"),
])
def test_a_file_says_what_its_inputs_are_by_its_format_or_the_column_they_come_from(tmp_path, name, content, kind):
    """The provider's rule reads each file's inputs as that kind (FASTA and a sequence column: proteins); a JSON
    Lines file is the kind of its first input's field."""
    path = tmp_path / name
    path.write_text(content)
    source = InputFile(path)
    source.check()
    assert source.kind == kind
    named = InputFile(path, column="id")
    named.check()
    assert named.kind is None  # a column of the caller's own: the provider's first kind


def test_gzip_inputs_read_like_plain_ones_and_bad_gzip_is_one_error(tmp_path):
    with gzip.open(tmp_path / "seqs.fasta.gz", "wb") as out:
        out.write(b">a\nMKV\n>b\nLLA\n")
    assert [r.text for r in _records(tmp_path / "seqs.fasta.gz")] == ["MKV", "LLA"]
    with gzip.open(tmp_path / "rows.tsv.gz", "wt") as out:
        out.write("id\tsequence\nx\tMKV\n")
    assert [r.id for r in _records(tmp_path / "rows.tsv.gz")] == ["x"]
    (tmp_path / "plain.fa.gz").write_bytes(b">a\nMKV\n")
    with pytest.raises(InputError, match="not gzip-compressed"):
        InputFile(tmp_path / "plain.fa.gz").check()
    data = gzip.compress(b">a\nMKV\n" * 100_000)
    (tmp_path / "cut.fasta.gz").write_bytes(data[: len(data) // 2])
    source = InputFile(tmp_path / "cut.fasta.gz")
    source.check()
    with pytest.raises(InputError, match="compressed data is damaged"):
        list(source.records())


def test_csv_and_tsv_columns_match_ignoring_case_and_can_be_named(tmp_path):
    (tmp_path / "a.csv").write_text("\ufeffEntry,Organism,SEQUENCE\nP1,human,mkv\nP2,\"mouse, lab\",LLA\n\n")
    records = _records(tmp_path / "a.csv")
    # A sequence column is read as FASTA is: upper case (review of issue 15, finding 11).
    assert [(r.id, r.text, r.line) for r in records] == [("P1", "MKV", 2), ("P2", "LLA", 3)]
    (tmp_path / "b.tsv").write_text("name\tprotein\tnote\nq1\tMKV\tx\nq2\t\ty\n")
    records = _records(tmp_path / "b.tsv", column="Protein", id_column="NAME")
    assert [(r.id, r.text) for r in records] == [("q1", "MKV"), ("q2", "")]
    assert records[1].error.endswith("3: no value in column 'protein'")
    with pytest.raises(InputError) as raised:
        InputFile(tmp_path / "b.tsv").check()
    assert "no column named 'sequence' or 'text'" in str(raised.value) and "--column" in str(raised.value)
    assert "its header row has 3 column(s), none so named" in str(raised.value)  # never quoted (issue 31, 12)
    with pytest.raises(InputError, match="--id-column"):
        InputFile(tmp_path / "b.tsv", column="protein", id_column="accession").check()


def test_a_csv_row_over_the_limit_or_not_utf8_fails_alone(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes(b"id,sequence\na,MKV\nb," + b"M" * 5000 + b"\nc,caf\xe9\nd,\"two\nlines\"\ne,LLA\n")
    records = _records(path, max_record_bytes=1000)
    # A field may not span lines (a stray quote must not swallow the rows after it): each line fails alone.
    assert [r.id for r in records] == ["a", "line-3", "line-4", "line-5", 'lines"', "e"]
    assert records[1].error.startswith(f"{path}:3: ") and "over the 1000-byte record limit" in records[1].error
    assert "not UTF-8" in records[2].error and "never closed" in records[3].error and records[4].error
    assert (records[5].text, records[5].line) == ("LLA", 7)


def test_jsonl_bad_lines_fail_alone(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"id": "a", "sequence": "MKV"}\n' + b"[" * 50_000 + b"]" * 50_000 + b"\n" + b"\n"
                     + b'{"ID": "c", "Text": "LLA"}\n' + b'["not", "an", "object"]\n' + b"{broken\n"
                     + b'{"id": "f", "sequence": 7}\n' + b'{"id": "g", "sequence": "caf\xe9"}\n')
    records = _records(path)
    assert [(r.id, r.line) for r in records] == [("a", 1), ("line-2", 2), ("c", 4), ("line-5", 5), ("line-6", 6),
                                                 ("f", 7), ("line-8", 8)]
    assert [r.text for r in records if r.error is None] == ["MKV", "LLA"]
    assert "nested too deeply" in records[1].error and "not an object" in records[3].error
    assert "not JSON" in records[4].error and "no non-empty string field" in records[5].error
    assert "not UTF-8" in records[6].error


@pytest.mark.parametrize(("name", "content", "words"), [
    ("random.fasta", os.urandom(200_000), "not a FASTA input file"),
    ("empty.fasta", b"", "it is empty"),
    ("words.fasta", b"this is a letter, not a FASTA file\n" * 3000, "before the first '>' header"),
    ("binary.jsonl", bytes(range(256)) * 300, "not a JSONL input file"),
    ("picture.csv", b"\x89PNG\r\n\x1a\n" + os.urandom(70_000), "not a CSV input file"),
])
def test_a_file_with_no_valid_record_in_its_first_64_kib_is_one_clear_error(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputError) as raised:
        InputFile(path).check()
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and words in message and "\n" not in message
    assert "expected" in message


def test_a_first_record_longer_than_the_sniff_is_still_an_input(tmp_path):
    (tmp_path / "long.fasta").write_bytes(b">titin\n" + b"MKV" * 40_000 + b"\n")
    (tmp_path / "long.jsonl").write_text(json.dumps({"sequence": "M" * 100_000}) + "\n")
    (tmp_path / "long.csv").write_text("sequence\n" + "M" * 100_000 + "\n")
    for name in ("long.fasta", "long.jsonl", "long.csv"):
        assert len(_records(tmp_path / name)[0].text) >= 100_000


def test_what_is_not_an_input_file_is_refused_by_name(tmp_path):
    with pytest.raises(InputError, match="unknown input format"):
        InputFile(tmp_path / "notes.txt")
    with pytest.raises(InputError, match="no such input file"):
        InputFile(tmp_path / "missing.fasta").check()
    os.mkfifo(tmp_path / "pipe.fasta")
    with pytest.raises(InputError, match="not a regular file"):
        InputFile(tmp_path / "pipe.fasta").check()


# -- outside review of issue 15 (findings 3 and 11) ----------------------------------------------------------------
def test_a_tsv_field_that_opens_a_quote_does_not_swallow_the_rows_after_it(tmp_path):
    """A UniProt-style TSV (no quoting) whose free-text column starts with a stray '"': every row is still an
    input with its own record; none vanishes without a failure naming it."""
    rows = ["Entry\tProtein names\tSequence"]
    for i in range(50_000):
        name = '"Uncharacterized protein' if i == 10 else f"protein {i}"
        rows.append(f"P{i:05d}\t{name}\tMKVLLAGG")
    path = tmp_path / "uniprot.tsv"
    path.write_text("\n".join(rows) + "\n")
    records = _records(path, id_column="Entry")
    bad = [r for r in records if r.error]
    assert len(records) == 50_000, f"50,000 rows, {len(records)} records, {len(bad)} bad: {bad[:1]}"
    assert not bad and [r.id for r in records[9:12]] == ["P00009", "P00010", "P00011"]


def test_a_short_tsv_with_a_stray_quote_does_not_merge_rows_into_one_valid_input(tmp_path):
    path = tmp_path / "small.tsv"
    path.write_text('id\tsequence\nx\t"MKV\ny\tGG\nz\tAA\n')
    records = _records(path)
    texts = [r.text for r in records if r.error is None]
    assert all("\n" not in t for t in texts), f"one input's text holds other rows: {texts}"
    assert [r.id for r in records] == ["x", "y", "z"]
    assert [r.text for r in records[1:]] == ["GG", "AA"]


def test_a_csv_row_with_an_unclosed_quote_fails_alone_and_the_rows_after_it_are_read(tmp_path):
    """CSV keeps its quoting (a quoted name may hold commas), but a quote left open fails its own row only."""
    path = tmp_path / "small.csv"
    path.write_text('id,name,sequence\nx,"Uncharacterized, protein,MKV\ny,"kinase, putative",GG\nz,plain,AA\n')
    records = _records(path)
    assert [r.id for r in records] == ["line-2", "y", "z"], records
    assert records[0].error and "small.csv:2" in records[0].error and "quote" in records[0].error
    assert [r.text for r in records[1:]] == ["GG", "AA"]


def test_every_row_of_a_table_ends_as_a_record_whatever_its_quotes(tmp_path):
    """Random quotes, tabs and commas in every column: one record (good or bad) per non-blank data line."""
    chooser = random.Random(15)
    pieces = ['"', "'", ",", "\t", "a", "MKV", " ", '""']
    for suffix, delimiter in ((".tsv", "\t"), (".csv", ",")):
        lines = ["id" + delimiter + "note" + delimiter + "sequence"]
        for i in range(500):
            note = "".join(chooser.choice(pieces) for _ in range(chooser.randint(0, 6)))
            lines.append(f"r{i}{delimiter}{note}{delimiter}MKV")
        path = tmp_path / f"noisy{suffix}"
        path.write_text("\n".join(lines) + "\n")
        records = list(InputFile(path).records())
        assert len(records) == 500, (suffix, len(records))
        assert all("\n" not in r.text for r in records)


def test_a_fasta_saved_with_a_utf8_bom_is_read(tmp_path):
    path = tmp_path / "notepad.fasta"
    path.write_bytes(b"\xef\xbb\xbf>sp|P1|X first\nMKVLA\n>second\nGG\n")
    InputFile(path).check()
    assert [(r.id, r.text) for r in InputFile(path).records()] == [("sp|P1|X", "MKVLA"), ("second", "GG")]


def test_a_jsonl_saved_with_a_utf8_bom_is_read(tmp_path):
    path = tmp_path / "notepad.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "sequence": "MKV"}\n')
    assert [(r.id, r.text, r.error) for r in _records(path)] == [("a", "MKV", None)]


def test_the_same_sequence_is_the_same_input_in_fasta_and_in_a_table(tmp_path):
    """FASTA input is upper-cased and stripped of spaces; the same protein in a CSV, TSV or JSONL sequence
    field is the same input (one key, computed once)."""
    (tmp_path / "a.fasta").write_text(">x\nmkv lla\n")
    (tmp_path / "a.csv").write_text("id,sequence\nx,mkv lla\n")
    (tmp_path / "a.tsv").write_text("id\tSequence\nx\tmkv lla\n")
    (tmp_path / "a.jsonl").write_text('{"id": "x", "seq": "mkv lla"}\n')
    texts = {name: next(InputFile(tmp_path / name).records()).text for name in ("a.fasta", "a.csv", "a.tsv",
                                                                              "a.jsonl")}
    assert set(texts.values()) == {"MKVLLA"}, texts


def test_a_text_column_is_not_upper_cased_like_a_sequence(tmp_path):
    """minilm embeds sentences: a "text" field is kept as written (stripped only)."""
    (tmp_path / "t.jsonl").write_text('{"id": "x", "text": " Hello world "}\n')
    (tmp_path / "t.csv").write_text("id,sequence\nx,Not a protein: 42\n")
    assert next(InputFile(tmp_path / "t.jsonl").records()).text == "Hello world"
    assert next(InputFile(tmp_path / "t.csv").records()).text == "Not a protein: 42"


@pytest.mark.parametrize("how", ["rewritten in place", "appended to"])
def test_a_file_changed_while_it_is_read_is_refused_by_name_not_read_as_a_mix(tmp_path, how):
    """Review of issue 15, Risks: an inbox file rewritten in place (or still being copied in) while a run reads
    it would give an output mixing both versions; the reader says the file changed, and the next run reads it
    whole."""
    path = tmp_path / "week.fasta"
    path.write_text("".join(f">old{n}\nMKVL\n" for n in range(2000)))
    os.utime(path, (1_700_000_000, 1_700_000_000))  # written a while ago, as an inbox file is
    source = InputFile(path)
    records = source.records()
    assert next(records).id == "old0"
    if how == "appended to":
        with open(path, "a") as out:
            out.write(">late\nGG\n")
    else:
        with open(path, "r+") as out:
            out.write(">new0\nAAAA\n")
    with pytest.raises(InputError) as raised:
        list(records)
    assert str(path) in str(raised.value) and "changed while it was read" in str(raised.value)
    assert len(list(InputFile(path).records())) >= 2000  # read again, whole, by the next run


# -- review round 3 (issue 24): an input is opened, never followed ------------------------------------------------
SECRET = "ghp_0123456789abcdefSECRET"


def _secret_file(folder):
    secret = folder / "git-credentials"
    secret.write_text(f"https://alice:{SECRET}@github.com\n")
    os.chmod(secret, 0o600)
    return secret


def test_a_link_as_an_input_is_refused_and_its_target_never_read(tmp_path):
    secret = _secret_file(tmp_path)
    (tmp_path / "creds.csv").symlink_to(secret)
    (tmp_path / "env.csv").symlink_to("/proc/self/environ")
    for name, said in (("creds.csv", "a symbolic link; an input is opened, never followed"),
                       ("env.csv", "lies under /proc, a kernel or device folder, never an input")):
        with pytest.raises(InputError) as refused:
            InputFile(tmp_path / name).check()
        assert said in str(refused.value)
        assert SECRET not in str(refused.value) and "PATH=" not in str(refused.value)


def test_a_link_to_a_folder_on_the_way_is_refused_and_nothing_behind_it_read(tmp_path):
    """Issue 31, finding 4: O_NOFOLLOW guarded only the last component; with `sub` a link planted by another user
    in a shared inbox to the victim's private folder, open_input("inbox/sub/x.fasta") returned the private bytes."""
    private = tmp_path / "home"
    (private / "deep").mkdir(parents=True, mode=0o700)
    (private / "x.fasta").write_text(">secret-id\nMKVLAAGIV\n")
    (private / "deep" / "y.fasta").write_text(">deep-secret\nMKV\n")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    os.chmod(inbox, 0o777)
    (inbox / "sub").symlink_to(private)
    (tmp_path / "alias").symlink_to(inbox)
    for given, link in ((inbox / "sub" / "x.fasta", inbox / "sub"), (inbox / "sub" / "deep" / "y.fasta", inbox / "sub"),
                        (tmp_path / "alias" / "sub" / "x.fasta", tmp_path / "alias")):
        with pytest.raises(InputError) as refused:
            InputFile(given).check()
        message = str(refused.value)
        assert f"the folder {link} on its way is a symbolic link; an input is opened, never followed, on any part " \
               "of its path" in message, message
        assert "secret" not in message and "MKV" not in message
    assert [r.id for r in _records(private / "x.fasta")] == ["secret-id"]  # by its own path, read
    with pytest.raises(InputError, match="no such input file"):
        InputFile(tmp_path / "gone" / "x.fasta").check()
    (tmp_path / "plain").write_text("")
    with pytest.raises(InputError, match="plain is not a folder"):
        InputFile(tmp_path / "plain" / "x.fasta").check()


@pytest.mark.parametrize("path", ["/proc/self/environ", "/proc/self/cwd/x.csv", "/sys/kernel/notes.csv",
                                  "/dev/stdin.fasta", "/dev/shm/../../proc/self/environ"])
def test_anything_under_proc_sys_or_dev_is_refused_by_name(path):
    with pytest.raises(InputError, match="a kernel or device folder, never an input"):
        inputs.open_input(__import__("pathlib").Path(path))


def test_a_hard_link_in_a_folder_others_can_write_is_refused_but_one_in_your_own_is_read(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    original = private / "mine.fasta"
    original.write_text(">secret-id\nMKVLAAGIV\n")
    os.chmod(original, 0o600)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # an inbox anyone can drop into: a link planted there may be to your file
    os.link(original, shared / "planted.fasta")
    with pytest.raises(InputError, match=r"has 2 hard links and lies in a folder (group and )?others can write into"):
        InputFile(shared / "planted.fasta").check()
    os.link(original, private / "again.fasta")  # your own second name for your own file, in your own folder
    assert [r.id for r in _records(private / "again.fasta")] == ["secret-id"]


def test_a_hard_link_in_a_folder_another_user_owns_is_refused_and_never_quoted(tmp_path, other_user):
    """A folder owned by another user, mode 0755: nobody else may write there, but its owner may plant a second
    name for your private file (where fs.protected_hardlinks is off; root makes the link here in their stead).
    Read, the header-row error would quote most of the token."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    secret = home / ".git-credentials"
    secret.write_text("https://alice:ghp_4Xb9SECRETtoken0123456789abcdefXYZ@github.com\n")
    secret.chmod(0o600)
    shared = tmp_path / "from-mallory"
    shared.mkdir(mode=0o755)
    shutil.chown(shared, other_user, other_user)
    planted = shared / "creds.csv"
    os.link(secret, planted)
    with pytest.raises(InputError) as refused:
        InputFile(planted).check()
    assert "ghp_" not in str(refused.value), str(refused.value)
    assert f"has 2 hard links and lies in a folder its owner ({other_user}, uid" in str(refused.value)


def test_a_table_without_its_column_is_refused_without_quoting_its_header_row(tmp_path):
    """Issue 31, finding 12: `screen.py --input creds.csv` printed "its header row reads 'https://user:<secret>...";
    a refused file's content is never quoted, not even cut short and escaped."""
    (tmp_path / "creds.csv").write_text(f"https://alice:{SECRET}-cell@github.com,x\nvalue,y\n")
    (tmp_path / "wide.csv").write_text(f"token={SECRET}\x1b[31m," + "x" * 500 + "\nvalue\n")
    for name, columns in (("creds.csv", 2), ("wide.csv", 2)):
        with pytest.raises(InputError) as raised:
            InputFile(tmp_path / name).check()
        message = str(raised.value)
        assert "ghp_" not in message and "alice" not in message and "token" not in message and "\x1b" not in message
        assert f"no column named 'sequence' or 'text' or 'input' or 'seq' (matched ignoring case); its header row " \
               f"has {columns} column(s), none so named; name the input column with --column NAME" in message
    with pytest.raises(InputError, match=r"no column named 'smiles'.*has 2 column"):
        InputFile(tmp_path / "creds.csv", column="smiles").check()


@pytest.mark.parametrize("name", ["in.fasta", "in.jsonl", "in.fasta.gz", "in.jsonl.gz", "small.fasta.gz"])
def test_fraction_read_only_rises_follows_the_records_read_and_is_1_at_the_end(tmp_path, name):
    """The reports: bytes_read() was the whole size from record 10 on, and 0 after the last record; for a .gz under
    gzip's own 128 KiB read it was the whole size from the first record, so 38 % done was shown as 75 %."""
    rng = random.Random(7)
    count = 2000 if name.startswith("small") else 20_000
    texts = ["".join(rng.choices("ACDEFGHIKLMNPQRSTVWY", k=rng.randint(50, 400))) for _ in range(count)]
    text = "".join(f">s{n}\n{t}\n" for n, t in enumerate(texts)) if "fasta" in name else \
        "".join(json.dumps({"id": f"s{n}", "sequence": t}) + "\n" for n, t in enumerate(texts))
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as out:
            out.write(text)
    else:
        path.write_text(text)
    source = InputFile(path)
    seen = [source.fraction_read() for _ in source.records()]
    assert seen == sorted(seen) and seen[0] < 0.01, seen[:5]  # not read whole at once, whatever its size
    worst = max(range(count), key=lambda n: abs(seen[n] - (n + 1) / count))
    assert abs(seen[worst] - (worst + 1) / count) < 0.05, f"{worst + 1} of {count} records read said {seen[worst]}"
    assert source.fraction_read() == 1.0  # read to the end: all of it, not 0


def test_record_count_is_exact_for_plain_files_and_none_for_compressed_ones(tmp_path):
    (tmp_path / "a.fasta").write_bytes(b"\xef\xbb\xbf" + b"".join(b">s%d\nMKV\nAAA\n" % n for n in range(3000)))
    (tmp_path / "a.jsonl").write_text("".join('{"sequence": "MKV"}\n\n' for _ in range(70)))
    (tmp_path / "a.csv").write_text("id,sequence\n" + "".join(f"{n},MKV\n" for n in range(40)))
    with gzip.open(tmp_path / "a.fasta.gz", "wt") as out:
        out.write(">a\nMKV\n")
    for name, count in (("a.fasta", 3000), ("a.jsonl", 70), ("a.csv", 40), ("a.fasta.gz", None)):
        source = InputFile(tmp_path / name)
        assert source.record_count() == count, name
        if count is not None:
            assert len(list(source.records())) == count, name


@pytest.mark.parametrize("block", [1, 5, 1 << 20])
def test_record_count_counts_lines_in_blocks_of_any_size(tmp_path, monkeypatch, block):
    monkeypatch.setattr(inputs, "FASTA_BLOCK", block)
    (tmp_path / "a.jsonl").write_text('{"sequence": "MKV"}\n \t\n\n{"sequence": "AAA"}\r\n   {"sequence": "W"}')
    assert InputFile(tmp_path / "a.jsonl").record_count() == 3


def test_record_count_of_a_file_past_the_byte_limit_is_none_and_the_records_refuse_it(tmp_path):
    (tmp_path / "big.csv").write_text("sequence\n" + "MKV\n" * 1000)
    source = InputFile(tmp_path / "big.csv", max_input_bytes=1000)
    assert source.record_count() is None
    with pytest.raises(InputError, match="RESIDENT_POOL_MAX_INPUT_BYTES"):
        list(source.records())


COUNT_UNDER_2_GIB = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
    from resident_pool.campaigns.inputs import InputFile
    source = InputFile(sys.argv[1], max_input_bytes=int(sys.argv[2]))
    source.check()  # passes: a header, then a field longer than the sniff
    print(source.record_count(), flush=True)
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("limit", [1_000_000, 10 * 2**30])
def test_a_sparse_input_is_counted_in_bounded_blocks_within_the_byte_limit(tmp_path, limit):
    """A 3 GiB sparse CSV costs its author nothing (`truncate -s`): a header, one row, then zero bytes with no
    newline. Counted line by line it was one 3 GiB line held at once: a MemoryError under a 2 GiB address
    space, outside any handler, that ended the whole flow run. Under a 1 MB limit it is not counted at all;
    under the default-sized one it is counted a block at a time."""
    big = tmp_path / "big.csv"
    big.write_bytes(b"sequence\nMKV\n")
    os.truncate(big, 3 * 2**30)
    done = subprocess.run([sys.executable, "-c", COUNT_UNDER_2_GIB, str(big), str(limit)], capture_output=True,
                          text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.split() == (["None"] if limit < 3 * 2**30 else ["2"])
