"""Prompts of the toy numbers task: two-digit numbers 10..99, in numerals and in words.

A number n = 10·a + b is drawn as digit a on the left half of an 8x16 canvas
and digit b on the right half. Prompts name it as a numeral ("the number 42"),
in words ("forty-two"), or digit by digit ("a 4 followed by a 2"). The
tokenizer reads numerals digit by digit, so every prompt is made of number
words, single numerals and template words.

Two kinds of held-out evaluation:
- phrasings: `HELDOUT_TEMPLATES` put words of the train templates (and only
  those: an untrained word's embedding is noise) into sentences never trained on;
- numbers: `HELDOUT_NUMBERS` are never drawn in pretraining nor prompted in
  RL training. Each is made of a tens word and a units word (and numerals)
  that other numbers train, so drawing it tests composition. A teen ("thirteen")
  is one word that only its own number uses, so no teen is held out.
"""

from __future__ import annotations

from engine.toy.prompts import DIGIT_WORDS, NUMERALS, split_words

TEEN_WORDS = ("ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
              "nineteen")
TENS_WORDS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")  # 20, 30, ..., 90

NUMBERS = tuple(range(10, 100))  # the task's numbers: two digits, no leading zero
HELDOUT_NUMBERS = (27, 38, 53, 64, 96)  # never trained on: composition only
TRAIN_NUMBERS = tuple(n for n in NUMBERS if n not in HELDOUT_NUMBERS)
# Evaluated numbers: the held-out ones and five trained ones, so that every digit
# 1-9 appears on the left and every digit 0-9 on the right. Ten numbers, so the
# judged sample grid has ten rows as toy-digits' has (one per number).
EVAL_NUMBERS = (10, 19, 27, 38, 41, 53, 64, 72, 85, 96)

# Fields: {numeral} "42", {words} "forty-two", {tens} "4" and {units} "2" (the two digits as numerals).
# No template may contain a number word or numeral of its own: parse_number would read another number.
TRAIN_TEMPLATES = (
    "the number {numeral}",
    "{words}",
    "a {tens} followed by a {units}",
    "{numeral}, handwritten",
    "{words} written by hand",
    "an image of the number {words}",
    "the digits {tens} and {units}",
    "a picture of {numeral}, written neatly",
)

# New sentences of trained words. Every recipe trains the transformer only, so a phrasing the
# frozen one-layer prompt encoder cannot read would cap the eval reward whatever the recipe:
# "a handwritten {numeral}" was such a one (0.10 after 120 GRPO steps, the other phrasings 0.9-0.99).
HELDOUT_TEMPLATES = (
    "the number {numeral}, written by hand",
    "a picture of the number {words}",
    "a {tens} and a {units}",
    "{words}, written neatly by hand",
)


def number_words(number: int) -> str:
    """A number 10..99 in words: "seventeen", "forty", "forty-two"."""
    _check_number(number)
    tens, units = divmod(number, 10)
    if tens == 1:
        return TEEN_WORDS[units]
    return TENS_WORDS[tens - 2] + (f"-{DIGIT_WORDS[units]}" if units else "")


def number_digits(number: int) -> tuple[int, int]:
    """(left digit, right digit) of a number 10..99: 42 -> (4, 2)."""
    _check_number(number)
    return divmod(number, 10)


def make_number_prompt(number: int, template: str) -> str:
    """Fill a template with a number 10..99."""
    tens, units = number_digits(number)
    return template.format(numeral=str(number), words=number_words(number), tens=str(tens), units=str(units))


def train_number_prompts() -> list[tuple[str, int]]:
    """Every (prompt, number) pair of the train templates and train numbers, number-major."""
    return [(make_number_prompt(n, t), n) for n in TRAIN_NUMBERS for t in TRAIN_TEMPLATES]


def heldout_number_prompts() -> list[tuple[str, int]]:
    """Every (prompt, number) pair of the held-out templates and the evaluated numbers, number-major."""
    return [(make_number_prompt(n, t), n) for n in EVAL_NUMBERS for t in HELDOUT_TEMPLATES]


_UNITS = {w: d for d, w in enumerate(DIGIT_WORDS)}
_TEENS = {w: 10 + d for d, w in enumerate(TEEN_WORDS)}
_TENS = {w: 20 + 10 * i for i, w in enumerate(TENS_WORDS)}


def parse_number(prompt: str) -> int | None:
    """The number 10..99 a prompt asks for, or None if it names none, several, or one outside 10..99.

    Numerals are read digit by digit and must be exactly two ("42", "a 4 followed
    by a 2"); words are a teen, a tens word, or a tens word and a units word
    ("forty-two"). A prompt naming a number both ways must name the same one.
    """
    words = split_words(prompt, numerals_apart=True)
    numerals = [int(w) for w in words if w in NUMERALS]
    found: list[int] = []
    if numerals:
        if len(numerals) != 2 or numerals[0] == 0:
            return None
        found.append(10 * numerals[0] + numerals[1])
    i = 0
    while i < len(words):
        word = words[i]
        if word in _TEENS:
            found.append(_TEENS[word])
        elif word in _TENS:
            units = _UNITS.get(words[i + 1]) if i + 1 < len(words) else None
            if units:  # "forty-two"; "forty zero" is not a number, and its "zero" is caught below
                i += 1
            found.append(_TENS[word] + (units or 0))
        elif word in _UNITS:
            return None  # a units word on its own is a digit, not a two-digit number
        i += 1
    return found[0] if found and len(set(found)) == 1 else None


def _template_words(template: str) -> set[str]:
    return set(split_words(template.format(numeral=" ", words=" ", tens=" ", units=" ")))


VOCABULARY = sorted(
    set().union(*(_template_words(t) for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES))
    | set(DIGIT_WORDS) | set(TEEN_WORDS) | set(TENS_WORDS) | set(NUMERALS)
)


def _check_number(number: int) -> None:
    if isinstance(number, bool) or not isinstance(number, int) or not 10 <= number <= 99:
        raise ValueError(f"a toy-numbers number is an int in 10..99, got {number!r}")
