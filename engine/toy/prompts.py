"""Prompts of the toy digits task: templates, the vocabulary they span, and a label parser.

Train templates are what the base model is pretrained on; held-out templates
are different phrasings made only of words the tokenizer knows, so that
evaluating on them measures generalisation to new wording, not to new words.
"""

from __future__ import annotations

import re

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
NUMERALS = tuple(str(d) for d in range(10))

# `{word}` is the digit as a word ("seven"), `{digit}` as a numeral ("7").
# No template may contain a digit word or numeral of its own ("one", "1"):
# parse_digit would then read two digits and call the prompt ambiguous.
TRAIN_TEMPLATES = (
    "a handwritten {word}",
    "the digit {word}",
    "number {digit}, written neatly",
    "a picture of a {digit}",
    "an image of the digit {digit}",
    "{word} written by hand",
    "a drawing of the number {word}",
    "a small scanned image of a handwritten {digit}",
)

HELDOUT_TEMPLATES = (
    "{word}, handwritten",
    "the number {digit}",
    "a neatly written digit: {word}",
    "drawing of a {digit}, scanned",
)

_WORD_RE = re.compile(r"[a-z0-9]+")
# Numerals apart: "42" is the two words "4" and "2", so a number never seen in
# training is still made of known words (toy-numbers composes them).
_WORD_NUMERALS_APART_RE = re.compile(r"[a-z]+|[0-9]")


def split_words(text: str, numerals_apart: bool = False) -> list[str]:
    """Lowercase `text` and split it on anything that is not a letter or a digit (each digit alone if asked)."""
    return (_WORD_NUMERALS_APART_RE if numerals_apart else _WORD_RE).findall(text.lower())


def make_prompt(digit: int, template: str) -> str:
    """Fill a template with a digit (0-9), as a word or a numeral as the template asks."""
    if not 0 <= digit <= 9:
        raise ValueError(f"digit must be in 0..9, got {digit}")
    return template.format(word=DIGIT_WORDS[digit], digit=str(digit))


def train_prompts() -> list[tuple[str, int]]:
    """Every (prompt, digit) pair of the train templates, digit-major."""
    return [(make_prompt(d, t), d) for d in range(10) for t in TRAIN_TEMPLATES]


def heldout_prompts() -> list[tuple[str, int]]:
    """Every (prompt, digit) pair of the held-out templates, digit-major."""
    return [(make_prompt(d, t), d) for d in range(10) for t in HELDOUT_TEMPLATES]


_TOKEN_TO_DIGIT = {**{w: d for d, w in enumerate(DIGIT_WORDS)}, **{n: d for d, n in enumerate(NUMERALS)}}


def parse_digit(prompt: str) -> int | None:
    """The digit a prompt asks for (numeral or word), or None if it names none or several."""
    found = {_TOKEN_TO_DIGIT[w] for w in split_words(prompt) if w in _TOKEN_TO_DIGIT}
    return found.pop() if len(found) == 1 else None


def _template_words(template: str) -> set[str]:
    return set(split_words(template.format(word=" ", digit=" ")))


VOCABULARY = sorted(
    set().union(*(_template_words(t) for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES))
    | set(DIGIT_WORDS) | set(NUMERALS)
)
