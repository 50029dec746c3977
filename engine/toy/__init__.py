"""The built-in toy model (`toy-digits`): prompts, tokenizer, transformer and card.

The card itself registers when `engine.toy.card` is imported (the card
registry does so lazily); importing this package stays light.
"""

from engine.toy.prompts import (
    DIGIT_WORDS,
    HELDOUT_TEMPLATES,
    TRAIN_TEMPLATES,
    VOCABULARY,
    heldout_prompts,
    make_prompt,
    parse_digit,
    train_prompts,
)

__all__ = [
    "DIGIT_WORDS",
    "HELDOUT_TEMPLATES",
    "TRAIN_TEMPLATES",
    "VOCABULARY",
    "heldout_prompts",
    "make_prompt",
    "parse_digit",
    "train_prompts",
]
