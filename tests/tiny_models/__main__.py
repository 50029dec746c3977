"""`python tests/tiny_models --card sd3 --out /tmp/tiny-sd3`: a tiny random folder of a card, for a smoke test."""

import sys
from pathlib import Path

if not __package__:  # run as a folder (python tests/tiny_models): its parent is not on sys.path yet
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models.folders import main  # noqa: E402

raise SystemExit(main())
