"""Whether a screen's answers tell its inputs apart: the figures `make run` must show (issue 33).

    .venv/bin/python bench/answers.py [--input data/uniprot-500.fasta]
                                      [--output out/uniprot-500.fasta.minilm.jsonl] [--cosine 0.9999]

Reads the input file as the campaign did and its output (JSON Lines), then
prints: how many distinct sequences got how many distinct answers, the pairs of
distinct sequences whose answers lie within ``--cosine`` of each other (and the
closest pair), whether repeated sequences share their answer, the unknown tokens,
and how token counts follow sequence length. Exits 1 when distinct sequences
share an answer or any token is unknown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resident_pool.campaigns.inputs import InputFile  # noqa: E402 - after the checkout is on the path
from resident_pool.providers.manifest import Answers  # noqa: E402
from resident_pool.validation.sanity import judge, vectors  # noqa: E402


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    at = 0
    while at < len(order):
        end = at
        while end + 1 < len(order) and values[order[end + 1]] == values[order[at]]:
            end += 1
        for k in range(at, end + 1):
            ranks[order[k]] = (at + end) / 2
        at = end + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Rank correlation: 1 when one grows exactly as the other does."""
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / ((sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=str(ROOT / "data" / "uniprot-500.fasta"))
    parser.add_argument("--output", default=str(ROOT / "out" / "uniprot-500.fasta.minilm.jsonl"))
    parser.add_argument("--cosine", type=float, default=0.9999)
    args = parser.parse_args(argv)
    source = InputFile(args.input)
    source.check()
    records = list(source.records())
    with open(args.output, encoding="utf-8") as handle:
        answers = [json.loads(line) for line in handle]
    if len(answers) != len(records):
        print(f"{args.output} holds {len(answers)} records for the {len(records)} inputs of {args.input}")
        return 1
    failed = [answer for answer in answers if not answer.get("ok")]
    found = vectors(answers, "embedding")
    first: dict[str, int] = {}
    for at, record in enumerate(records):
        first.setdefault(record.text, at)
    repeats = [(first[record.text], at) for at, record in enumerate(records) if first[record.text] != at]
    shared = all(found[a] == found[b] for a, b in repeats)
    keep = sorted(first.values())
    verdict = judge(Answers(embedding="embedding", distinct_cosine=args.cosine, checks=["distinct", "finite"]),
                    [records[at].id for at in keep], [records[at].text for at in keep], [answers[at] for at in keep])
    figures = verdict.figures
    distinct_answers = len({tuple(found[at]) for at in keep if found[at] is not None})
    tokens = [answer.get("tokens") for answer in answers]
    unknown = [answer.get("unknown_tokens") for answer in answers]
    lengths = [len(record.text) for record in records]
    windows = [answer.get("windows") for answer in answers]
    named = os.path.relpath(args.input) if not os.path.relpath(args.input).startswith("..") else args.input
    print(f"inputs: {len(records)} records in {named}, {len(keep)} distinct sequences; "
          f"{len(answers) - len(failed)} answered ok, {len(failed)} failed")
    print(f"distinct answers: {distinct_answers} for the {len(keep)} distinct sequences")
    print(f"pairs of distinct sequences within cosine {args.cosine:g}: {figures.get('close_pairs')} of "
          f"{figures.get('pairs'):,}; the closest pair at cosine {figures.get('closest_cosine'):.6f}")
    print(f"repeated sequences: {len(repeats)}, " + ("each shares its first occurrence's answer" if shared
                                                    else "NOT all sharing their first occurrence's answer"))
    if all(isinstance(u, int) for u in unknown):
        print(f"unknown tokens: {sum(unknown)} in all, {sum(1 for u in unknown if u)} inputs with any")
    else:
        print("unknown tokens: not reported by every record")
    if all(isinstance(t, int) for t in tokens):
        same = sum(1 for t, n in zip(tokens, lengths, strict=True) if t == n)
        print(f"tokens: {min(tokens)} to {max(tokens)} (median {statistics.median(tokens):g}); equal to the sequence "
              f"length for {same} of {len(tokens)}; rank correlation with length {spearman(tokens, lengths):.4f}")
    if all(isinstance(w, int) for w in windows):
        print(f"windows: {min(windows)} to {max(windows)}, {sum(windows)} model passes in all")
    bad = (failed or distinct_answers < len(keep) or figures.get("close_pairs") or not shared
           or not all(u == 0 for u in unknown))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
