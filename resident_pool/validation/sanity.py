"""Whether a provider's answers mean something: the checks its manifest's ``[answers]`` declares.

Pure: no files, no processes. Given the inputs a provider answered and its
answer items, it says whether distinct inputs got distinct answers, how many of
the tokens read were unknown to the model, whether the answers are finite and
point somewhere (none all zero, none one value throughout), whether they vary
at all, and whether known relations hold (a point mutant nearer its parent
than an unrelated protein). A model that maps most inputs to one vector passes
every golden comparison of itself; it fails here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..providers.manifest import Answers
from .golden import decode_f32

__all__ = ["Verdict", "judge", "vectors"]

SHOWN = 3  # examples named per failed check


@dataclass
class Verdict:
    """What the checks found: ``problems`` (each a sentence; none: they pass), ``said`` (every check's finding) and
    the figures behind them, for scripts."""

    problems: list[str] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        return "; ".join(self.problems or self.said)


def vectors(items: Sequence[Any], name: str) -> list[list[float] | None]:
    """Each item's vector under ``name`` (a list or array of numbers), or base64 float32 under ``name`` + "_f32";
    None for an item that holds neither."""
    found: list[list[float] | None] = []
    for item in items:
        value = item.get(name) if isinstance(item, dict) else None
        if value is None and isinstance(item, dict) and isinstance(item.get(f"{name}_f32"), str):
            try:
                value = decode_f32(item[f"{name}_f32"])
            except ValueError:
                value = None
        if hasattr(value, "tolist"):  # a numpy row, from an answer sent as an array
            value = value.tolist()
        numbers = isinstance(value, list) and value and all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in value)
        found.append([float(x) for x in value] if numbers else None)
    return found


def judge(answers: Answers, ids: Sequence[str], texts: Sequence[str], items: Sequence[Any]) -> Verdict:
    """Run the declared checks over answers ``items`` to inputs ``texts`` named ``ids`` (all in input order)."""
    verdict = Verdict()
    if answers.embedding is None:
        verdict.said.append("no [answers] embedding declared: the answers are not judged")
        return verdict
    checks = set(answers.checks)
    found = vectors(items, answers.embedding)
    verdict.figures["answers"] = len(found)
    missing = [ident for ident, vector in zip(ids, found, strict=True) if vector is None]
    if missing:
        verdict.problems.append(f"{len(missing)} of {len(found)} answers hold no {answers.embedding!r} vector "
                                f"({_some(missing)})")
        return verdict
    vectors_ = [vector for vector in found if vector is not None]
    if "finite" in checks:
        bad = [ident for ident, vector in zip(ids, vectors_, strict=True) if not all(map(math.isfinite, vector))]
        verdict.figures["not_finite"] = len(bad)
        if bad:
            verdict.problems.append(f"{len(bad)} answers hold NaN or an infinity ({_some(bad)})")
            return verdict  # nothing below means anything then
        hollow = [(ident, how) for ident, vector in zip(ids, vectors_, strict=True)
                  if (how := _hollow(vector)) is not None]
        verdict.figures["hollow"] = len(hollow)
        if hollow:
            verdict.problems.append(
                f"{len(hollow)} of {len(vectors_)} answers carry no direction: "
                f"{_some([f'{ident} ({how})' for ident, how in hollow])}; a model that answers zeros (an all-masked "
                "pool, an input it did not read) or one value throughout answers nothing")
        else:
            verdict.said.append(f"{len(vectors_)} answers, all finite, none zero or constant")
    units = [_unit(vector) for vector in vectors_]
    if len(set(texts)) < 2 and checks & {"distinct", "spread"}:
        verdict.said.append(f"{len(set(texts))} distinct smoke input: distinct and spread compare nothing (give "
                            "[smoke] two or more distinct inputs)")
    if "spread" in checks:
        _spread(answers, vectors_, verdict)
    if "distinct" in checks:
        _distinct(answers, ids, texts, units, verdict)
    if "unknown_tokens" in checks:
        _unknown(answers, ids, items, verdict)
    if "relations" in checks and answers.relations:
        _relations(answers, ids, units, verdict)
    return verdict


def _spread(answers: Answers, found: list[list[float]], verdict: Verdict) -> None:
    """The root mean square distance of the answers from their mean: 0 when every input gets the same answer."""
    if len(found) < 2:
        return
    mean = [sum(column) / len(found) for column in zip(*found, strict=True)]
    spread = math.sqrt(sum(sum((x - m) ** 2 for x, m in zip(vector, mean, strict=True)) for vector in found)
                       / len(found))
    verdict.figures["spread"] = spread
    if spread < answers.min_spread:
        verdict.problems.append(f"the answers do not vary: their spread (root mean square distance from their mean) "
                                f"is {spread:.3g}, under {answers.min_spread:g}")
    else:
        verdict.said.append(f"spread {spread:.3g}")


def _distinct(answers: Answers, ids: Sequence[str], texts: Sequence[str], units: list[list[float]],
              verdict: Verdict) -> None:
    """Pairs of distinct inputs whose answers lie within ``distinct_cosine``: a model that cannot tell them apart.
    A repeated input shares its answer by right, and a declared relation's anchor and closer may lie that near."""
    where = {ident: at for at, ident in enumerate(ids)}
    related = {tuple(sorted((where[r.anchor], where[r.closer]))) for r in answers.relations
               if r.anchor in where and r.closer in where}
    pairs = close = 0
    closest: tuple[float, int, int] = (-2.0, -1, -1)
    examples: list[tuple[float, int, int]] = []
    dot = _dot
    zero = [not any(unit) for unit in units]  # no direction: two of them are one answer, not cosine 0 apart
    for i in range(len(units)):
        first = units[i]
        for j in range(i + 1, len(units)):
            if texts[i] == texts[j] or (i, j) in related:
                continue
            pairs += 1
            cosine = 1.0 if zero[i] and zero[j] else dot(first, units[j])
            if cosine > closest[0]:
                closest = (cosine, i, j)
            if cosine >= answers.distinct_cosine:
                close += 1
                if len(examples) < SHOWN:
                    examples.append((cosine, i, j))
    distinct = len(set(texts))
    verdict.figures.update({"distinct_inputs": distinct, "pairs": pairs, "close_pairs": close,
                            "close_rate": close / pairs if pairs else 0.0,
                            "closest_cosine": closest[0] if pairs else None})
    if not pairs:
        return
    shown = f"closest {ids[closest[1]]} and {ids[closest[2]]} at cosine {closest[0]:.6f}"
    if close > answers.max_close_pairs:
        named = ", ".join(f"{ids[i]} and {ids[j]} ({cosine:.6f})" for cosine, i, j in examples)
        verdict.problems.append(
            f"distinct inputs get the same answer: {close:,} of {pairs:,} pairs of distinct inputs "
            f"({100 * close / pairs:.1f}%) lie within cosine {answers.distinct_cosine:g} (at most "
            f"{answers.max_close_pairs:,} may), e.g. {named}")
    else:
        verdict.said.append(f"{close:,} of {pairs:,} pairs of distinct inputs within cosine "
                            f"{answers.distinct_cosine:g} ({shown})")


def _unknown(answers: Answers, ids: Sequence[str], items: Sequence[Any], verdict: Verdict) -> None:
    """The share of the tokens read that the model does not know, where the items report both counts."""
    counts = [(item.get("unknown_tokens"), item.get("tokens")) if isinstance(item, dict) else (None, None)
              for item in items]
    if not counts or not all(isinstance(u, int) and isinstance(t, int) for u, t in counts):
        verdict.said.append("unknown tokens not reported")
        return
    unknown, tokens = sum(u for u, _ in counts), sum(t for _, t in counts)
    holding = [ident for ident, (u, _) in zip(ids, counts, strict=True) if u]
    share = unknown / tokens if tokens else 0.0
    verdict.figures.update({"unknown_tokens": unknown, "tokens": tokens, "unknown_share": share,
                            "inputs_with_unknown_tokens": len(holding)})
    if share > answers.max_unknown_share:
        verdict.problems.append(
            f"the model reads inputs as unknown tokens: {unknown:,} of {tokens:,} tokens ({100 * share:.1f}%) "
            f"are unknown tokens (at most {100 * answers.max_unknown_share:g}% may be), in {len(holding)} of "
            f"{len(items)} inputs ({_some(holding)})")
    else:
        verdict.said.append(f"{unknown:,} of {tokens:,} tokens unknown")


def _relations(answers: Answers, ids: Sequence[str], units: list[list[float]], verdict: Verdict) -> None:
    where = {ident: at for at, ident in enumerate(ids)}
    for relation in answers.relations:
        absent = [name for name in (relation.anchor, relation.closer, relation.farther) if name not in where]
        if absent:
            verdict.problems.append(f"[[answers.relations]] names {', '.join(absent)}, which the smoke inputs do not "
                                    "hold (their ids are the FASTA ids, or 1, 2, ... for an inline payload)")
            continue
        anchor, closer = units[where[relation.anchor]], units[where[relation.closer]]
        near, far = _dot(anchor, closer), _dot(anchor, units[where[relation.farther]])
        words = f"{relation.closer} at cosine {near:.6f} to {relation.anchor}, {relation.farther} at {far:.6f}"
        if closer != anchor and near > far:
            verdict.said.append(f"{relation.why or 'the relation holds'}: {words}")
        else:
            how = (f"gets the same answer as {relation.anchor}" if closer == anchor else
                   f"lies no closer to {relation.anchor} than {relation.farther} does")
            verdict.problems.append(f"a known relation fails: {relation.closer} {how} ({words})"
                                    + (f"; expected: {relation.why}" if relation.why else ""))
        verdict.figures.setdefault("relations", []).append(
            {"anchor": relation.anchor, "closer": relation.closer, "farther": relation.farther,
             "closer_cosine": near, "farther_cosine": far})


def _hollow(vector: list[float]) -> str | None:
    """Why an answer vector carries no direction (all zero, or one value in every component), else None."""
    if not any(vector):
        return "all zero"
    if len(vector) > 1 and all(x == vector[0] for x in vector):
        return f"{vector[0]:g} throughout"
    return None


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(_dot(vector, vector))
    return [x / norm for x in vector] if norm else vector


def _dot(a: list[float], b: list[float]) -> float:
    return sum(map(operator.mul, a, b))


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN:,} more" if len(names) > SHOWN else "")
