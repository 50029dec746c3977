"""The built-in toy models (`toy-digits`, `toy-numbers`): prompts, tokenizer, transformer and cards.

The cards register when `engine.toy.card` is imported (the card registry
does so lazily); importing this package stays light. The toy-numbers prompts
live in `engine.toy.numbers`, pretraining in `engine.toy.pretrain`.
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
