"""Pretrain the `toy-numbers` base model: `scripts/pretrain_toy_digits.py --card toy-numbers`.

    python scripts/pretrain_toy_numbers.py    # engine/toy/weights/toy-numbers.safetensors, ~2.5 min on one thread
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_toy_digits import main  # noqa: E402

if __name__ == "__main__":
    main(card="toy-numbers")
