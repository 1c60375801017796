"""What one input to a provider may be: its manifest's ``[inputs]``, and the one rule every entry point applies.

A provider takes protein sequences, free text, or both (``kinds``, the first
the default). A protein is read as FASTA's sequences are (whitespace dropped,
upper case); the 20 standard residues always pass, and the manifest states what
happens to each of ``X``, ``B``, ``Z``, ``U``, ``O`` and ``*`` (``[inputs.protein]``).
Free text passes when it holds a visible character (a letter, number, punctuation
or symbol; not only whitespace, zero-width or control characters). ``check`` is
that rule: the predict flow, the screen flow, ``resident-pool predict`` and
``check``'s smoke set all call it, so an input passes or fails alike wherever it
is given.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["KINDS", "STANDARD_RESIDUES", "Inputs", "ProteinPolicy", "kind_option", "rule_inputs", "show_character"]

Kind = Literal["protein", "text"]
KINDS: tuple[str, ...] = ("protein", "text")
STANDARD_RESIDUES = "ACDEFGHIKLMNPQRSTVWY"
_STANDARD = STANDARD_RESIDUES.encode()
_WHITESPACE = b" \t\r\n\v\f"
SHOWN_CHARACTERS = 3  # of an invisible text, the distinct characters its refusal names
# What a letter a policy rules on may become: passed on, refused, or replaced by a standard residue (U -> C).
Action = Literal["accept", "refuse", "A", "C", "D", "E", "F", "G", "H", "I", "K", "L", "M", "N", "P", "Q", "R", "S",
                 "T", "V", "W", "Y"]
_NAMES = {"X": "an unknown residue", "B": "Asx (D or N)", "Z": "Glx (E or Q)", "U": "selenocysteine",
          "O": "pyrrolysine"}


class ProteinPolicy(BaseModel):
    """What a protein provider does with the letters beyond the 20 standard residues, and with ``*``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    X: Action = Field("accept", description="an unknown residue: accept, refuse, or a standard letter to put instead")
    B: Action = Field("refuse", description="Asx (D or N)")
    Z: Action = Field("refuse", description="Glx (E or Q)")
    U: Action = Field("refuse", description="selenocysteine (U = \"C\" reads it as cysteine)")
    O: Action = Field("refuse", description="pyrrolysine (O = \"K\" reads it as lysine)")  # noqa: E741 - its letter
    stop: Literal["trailing", "refuse", "accept"] = Field(
        "trailing", alias="*", description='"trailing": one final * (a translated stop codon) is dropped and one '
        'anywhere else refuses the input; "refuse": any *; "accept": passed on where it stands.')

    def accepted(self) -> str:
        """The letters beyond the standard 20 that pass (as given or replaced), in a stable order."""
        return "".join(letter for letter in "XBZUO" if getattr(self, letter) != "refuse")

    def describe(self) -> str:
        """The policy in words, for an error: what passes, what is replaced, what becomes of *."""
        words = ["the 20 standard residues"]
        for letter in "XBZUO":
            action = getattr(self, letter)
            if action == "accept":
                words.append(letter)
            elif action != "refuse":
                words.append(f"{letter} (read as {action})")
        star = {"trailing": "a final * dropped", "accept": "* passed on", "refuse": "no *"}[self.stop]
        return ", ".join(words) + f"; {star}"


class Inputs(BaseModel):
    """``[inputs]``: the kinds of input a provider takes and the rule for each. Absent: free text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kinds: list[Kind] = Field(
        default_factory=lambda: ["text"], min_length=1,
        description='"protein" (residue letters, ruled by [inputs.protein]) and/or "text" (anything but blank); the '
        "first is the default. A provider taking both gets \"kind\" in each request.")
    protein: ProteinPolicy = Field(default_factory=ProteinPolicy)

    @field_validator("kinds")
    @classmethod
    def _once_each(cls, values: list[str]) -> list[str]:
        if len(set(values)) != len(values):
            raise ValueError(f"{values} names a kind twice")
        return values

    @property
    def default_kind(self) -> str:
        return self.kinds[0]

    def kind_for(self, wanted: str | None) -> str:
        """The kind an input is read as: ``wanted`` (what its file or the caller says) where the provider takes it,
        else the provider's default (a protein-only provider reads a "text" column as proteins: its rule says
        which of them it can take)."""
        return wanted if wanted in self.kinds else self.default_kind

    def check(self, value: Any, kind: str) -> tuple[str, str | None]:
        """``value`` as the provider gets it, and ``None``; or ``("", why it is refused)``.

        The reason never repeats the input: at most one character of it, escaped.
        """
        if not isinstance(value, str):
            return "", f"{_json_kind(value)}, not text"
        if kind == "text":
            text = value.strip()
            if not text:
                return "", "empty: it holds no text"
            if not any(map(_visible, text)):
                shown = ", ".join(map(show_character, list(dict.fromkeys(text))[:SHOWN_CHARACTERS]))
                return "", f"empty: it holds no visible text, only invisible characters ({shown})"
            return text, None
        return self._protein(value)

    def _protein(self, value: str) -> tuple[str, str | None]:
        policy = self.protein
        try:
            raw = value.encode("ascii").translate(None, _WHITESPACE).upper()
        except UnicodeEncodeError:
            at = next(index for index, character in enumerate(value) if not character.isascii())
            return "", f"character {at + 1} is {show_character(value[at])}, which is not a residue letter"
        if policy.stop == "trailing" and raw.endswith(b"*"):
            raw = raw[:-1]
        if not raw:
            return "", "empty: it holds no residue letters"
        if not raw.translate(None, _STANDARD):  # the common case: standard residues only
            return raw.decode("ascii"), None
        out = bytearray()
        for position, byte in enumerate(raw, 1):
            letter = chr(byte)
            if byte in _STANDARD:
                out.append(byte)
            elif letter in _NAMES:
                action = getattr(policy, letter)
                if action == "refuse":
                    return "", (f"position {position} is {letter}, {_NAMES[letter]}, which this provider refuses; "
                                f"it takes {policy.describe()}")
                out += (letter if action == "accept" else action).encode()
            elif letter == "*":
                if policy.stop != "accept":
                    where = "a stop (*) before the end" if policy.stop == "trailing" else "a stop (*)"
                    return "", (f"position {position} is {where}, which this provider refuses; it takes "
                                f"{policy.describe()}")
                out.append(byte)
            elif letter in "-.":
                return "", f"position {position} is a gap ({letter}); give the sequence without its alignment gaps"
            else:
                return "", (f"position {position} holds {show_character(letter)}, which is not a residue letter; this "
                            f"provider takes {policy.describe()}")
        return out.decode("ascii"), None


def rule_inputs(inputs: Inputs, values: list[Any], kind: str) -> tuple[list[str], list[int], dict[int, str]]:
    """A list of inputs given by hand (the predict flow, ``resident-pool predict``): the texts to send, their
    positions in ``values``, and why each other position is refused, naming it ("input 3 of 5: ...")."""
    texts, kept, refused = [], [], {}
    for position, value in enumerate(values):
        text, problem = inputs.check(value, kind)
        if problem is None:
            texts.append(text)
            kept.append(position)
        else:
            refused[position] = f"input {position + 1} of {len(values)}: {problem}"
    return texts, kept, refused


def kind_option(inputs: Inputs, kind: str) -> dict[str, str]:
    """What a request says of its inputs' kind: ``{"kind": ...}`` to a provider that takes several, else nothing
    (so a provider of one kind sees the same requests, and its stored results keep their keys)."""
    return {"kind": kind} if len(inputs.kinds) > 1 else {}


def _json_kind(value: Any) -> str:
    """What a value of a JSON payload is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def _visible(character: str) -> bool:
    """A character a tokenizer reads as something: a letter, number, punctuation or symbol. Not a control or
    format character (NUL, a zero-width space, a BOM, a soft hyphen), a separator, a combining mark on its own or
    U+FFFD (an undecodable byte), which a model's text cleaning drops: a text of nothing else reads as no token."""
    return unicodedata.category(character)[0] in "LNPS" and character != "\ufffd"


def show_character(character: str) -> str:
    """One character of an input as an error may show it: quoted when printable ASCII, else its code point."""
    if character.isascii() and character.isprintable():
        return repr(character)
    return f"U+{ord(character):04X}"
