"""Independent judges for evaluation only: never registered as rewards, so RL cannot optimise them.

A rising reward with a flat judge score is the signature of reward hacking
(the CNN reward is overconfident on noise-like images).

A judge is called like a scorer, `judge(images, prompts, metadata) -> [B]`
scores. Two optional methods let evaluation say more:

- `classes(prompts, metadata) -> [B]` list: the class each sample belongs to
  (None for a sample in none). A task "has classes" when one of its judges
  defines this; evaluation then reports the judge and the reward per class
  (`flywheel.rollout_collector.eval_samples`), which is where hacking shows first: one class
  collapsing into a blob the reward still accepts moves the overall mean little.
- `verdicts(images, prompts, metadata) -> [B]` list of `Verdict`: what the
  judge sees in each image, drawn on the sample grid (`flywheel.grids`).

Two judges for the toy digits, because each is blind where the other looks:
`DigitJudge` asks "is this the prompted digit?" and, like the reward CNN,
still says yes to a saturated blob that keeps a digit's rough shape;
`DigitTypicalityJudge` asks "does this look like real digits of that class?",
which such a blob does not. The toy numbers get the same two, one half of the
canvas at a time (`NumberJudge`, `NumberTypicalityJudge`); `judges_for_card`
says which judges evaluate which card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rewards.digits import (digit_split, prob_of_prompted, prob_of_prompted_pair, prompted_digits,
                            prompted_number_digits, to_digit_grid, to_digit_halves)


@dataclass(frozen=True)
class Verdict:
    """A judge's reading of one image: the class it sees, its probability, and the class the prompt asked for."""

    predicted: int | str
    score: float
    expected: int | str | None = None

    @property
    def agrees(self) -> bool | None:
        """Whether the judge sees the prompted class; None when the prompt names no class."""
        return None if self.expected is None else self.predicted == self.expected

    @property
    def label(self) -> str:
        """Short enough for a 32-pixel cell: the predicted class and its probability, e.g. "6:93%"."""
        return f"{self.predicted}:{self.score:.0%}"


class DigitJudge:
    """An RBF SVC with Platt-scaled probabilities, fit on the load_digits train split; called like a scorer."""

    name = "digit_judge"

    def __init__(self):
        # Imported here: scikit-learn takes ~1.7 s to import, which every recipe's start (and every config error
        # it prints) used to pay, judged or not.
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.svm import SVC

        x_train, _, y_train, _ = digit_split()
        # SVC(probability=True) is deprecated from scikit-learn 1.9 (removed in 1.11); this is its
        # documented replacement: 5-fold Platt scaling over one SVC refit on all the data.
        # Deterministic (unshuffled stratified folds), ~0.5 s on two cores.
        self.classifier = CalibratedClassifierCV(SVC(), method="sigmoid", cv=5, ensemble=False)
        # Same input convention as the reward CNN: value / 16 puts pixels into [0, 1].
        self.classifier.fit(x_train.reshape(len(x_train), -1) / 16.0, y_train)
        if list(self.classifier.classes_) != list(range(10)):
            raise RuntimeError(f"judge classes are {list(self.classifier.classes_)}; expected 0..9")

    def probs(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities [B, 10] float32 on the host."""
        flat = to_digit_grid(images.detach()).flatten(1).cpu().double().numpy()
        return torch.from_numpy(self.classifier.predict_proba(flat)).float()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Probability [B] float32 of each row's prompted digit; NaN where the prompt names none."""
        return prob_of_prompted(self.probs(images), prompted_digits(prompts, metadata))

    def classes(self, prompts: list[str], metadata: list[dict]) -> list[int | None]:
        """The digit each row asks for (metadata "digit", else parsed from the prompt; None if it names none)."""
        return prompted_digits(prompts, metadata)

    def verdicts(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> list[Verdict]:
        """Per image: the digit the judge sees, its probability, and the digit the prompt asked for."""
        expected = prompted_digits(prompts, metadata)
        probs = self.probs(images)
        if probs.shape[0] != len(expected):
            raise ValueError(f"got {probs.shape[0]} images and {len(expected)} prompts; they must match")
        score, predicted = probs.max(dim=1)
        return [Verdict(int(p), float(s), e) for p, s, e in zip(predicted.tolist(), score.tolist(), expected)]


class DigitTypicalityJudge:
    """How typical each sample is of real digits of its prompted class: an empirical p-value in [0, 1].

    A sample's distance to real digits of its class is the Euclidean distance
    (pixels in [0, 1]) to its nearest load_digits *train* image of that class.
    Its score is the fraction of *held-out* real digits of that class whose own
    nearest-train distance is at least as large: held-out real digits score
    about uniformly in [0, 1] (mean ~0.5), a sample further from the class than
    any real digit scores 0. It sees what a classifier cannot: a saturated blob
    that the reward CNN and `DigitJudge` still read as the prompted digit is far
    from every real one. Blind spot: a model that copies its training digits
    (the toy model trains on the same train split) scores ~1.

    Deterministic and untrained (no randomness, ~0.05 s to build): pure
    nearest-neighbour arithmetic on the same split as every other component.
    """

    name = "digit_typicality"

    def __init__(self):
        x_train, x_test, y_train, y_test = digit_split()
        # Same input convention as the reward CNN and DigitJudge: value / 16 puts pixels into [0, 1].
        train = torch.from_numpy(x_train.reshape(len(x_train), -1) / 16.0)
        test = torch.from_numpy(x_test.reshape(len(x_test), -1) / 16.0)
        self.references: list[torch.Tensor] = []  # per digit: its train images [N_c, 64] float64
        self.calibration: list[torch.Tensor] = []  # per digit: its held-out images' nearest-train distances, sorted
        for digit in range(10):
            reference = train[torch.from_numpy(y_train == digit)]
            heldout = test[torch.from_numpy(y_test == digit)]
            if len(reference) == 0 or len(heldout) == 0:
                raise RuntimeError(f"the load_digits split has no train or held-out image of digit {digit}")
            self.references.append(reference)
            self.calibration.append(_nearest_distance(heldout, reference).sort().values)

    def distances(self, images: torch.Tensor, digits: list[int | None]) -> torch.Tensor:
        """Distance [B] float64 from each image to its nearest train digit of `digits[i]`; NaN where None."""
        flat = to_digit_grid(images.detach()).flatten(1).cpu().double()
        if flat.shape[0] != len(digits):
            raise ValueError(f"got {flat.shape[0]} images and {len(digits)} prompts; they must match")
        if not torch.isfinite(flat).all():
            raise ValueError("images hold non-finite values; expected images in [0, 1]")
        out = torch.full((len(digits),), math.nan, dtype=torch.float64)
        for digit, rows in _rows_by_digit(digits):
            out[rows] = _nearest_distance(flat[rows], self.references[digit])
        return out

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Typicality [B] float32 of each row for its prompted digit; NaN where the prompt names none."""
        digits = prompted_digits(prompts, metadata)
        distance = self.distances(images, digits)
        scores = torch.full_like(distance, math.nan)
        for digit, rows in _rows_by_digit(digits):
            calibration = self.calibration[digit]
            # Held-out distances strictly below a sample's are the real digits more typical than it.
            below = torch.searchsorted(calibration, distance[rows], side="left")
            scores[rows] = 1.0 - below.double() / len(calibration)
        return scores.float()

    def classes(self, prompts: list[str], metadata: list[dict]) -> list[int | None]:
        """The digit each row asks for, exactly as `DigitJudge.classes` (so per-class metrics line up)."""
        return prompted_digits(prompts, metadata)


def _nearest_distance(points: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[N] Euclidean distance from each of `points` [N, D] to its nearest row of `reference` [M, D]."""
    # The direct (not matrix-product) form: exact, so an image that is a reference row is at distance 0.
    return torch.cdist(points, reference, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values


def _rows_by_digit(digits: list[int | None]) -> list[tuple[int, torch.Tensor]]:
    """(digit, boolean row mask) for every digit named in `digits`, in digit order."""
    named = sorted({d for d in digits if d is not None})
    return [(digit, torch.tensor([d == digit for d in digits])) for digit in named]


def _number_classes(pairs: list[tuple[int, int] | None]) -> list[int | None]:
    """A number's class is the number itself (10·left + right): one per evaluated number (ten for toy-numbers)."""
    return [None if p is None else 10 * p[0] + p[1] for p in pairs]


class NumberJudge:
    """`DigitJudge`'s SVC on each half of a two-digit canvas: P(left = tens) x P(right = units), as the reward."""

    name = "number_judge"

    def __init__(self, digit_judge: DigitJudge | None = None):
        self.digit_judge = digit_judge or DigitJudge()

    def half_probs(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(left, right) class probabilities [B, 10] float32 on the host."""
        left, right = to_digit_halves(images.detach())
        return self.digit_judge.probs(left), self.digit_judge.probs(right)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Probability [B] float32 of each row's prompted number; NaN where the prompt names none."""
        return prob_of_prompted_pair(*self.half_probs(images), prompted_number_digits(prompts, metadata))

    def classes(self, prompts: list[str], metadata: list[dict]) -> list[int | None]:
        """The number each row asks for (metadata "digits"/"number", else parsed; None if it names none)."""
        return _number_classes(prompted_number_digits(prompts, metadata))

    def verdicts(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> list[Verdict]:
        """Per image: the two digits the judge sees (e.g. "42"), the product of their probabilities, and the
        two digits the prompt asked for."""
        pairs = prompted_number_digits(prompts, metadata)
        left, right = self.half_probs(images)
        if left.shape[0] != len(pairs):
            raise ValueError(f"got {left.shape[0]} images and {len(pairs)} prompts; they must match")
        (p_left, d_left), (p_right, d_right) = left.max(dim=1), right.max(dim=1)
        expected = [None if p is None else f"{p[0]}{p[1]}" for p in pairs]
        return [Verdict(f"{a}{b}", pa * pb, e) for a, b, pa, pb, e in
                zip(d_left.tolist(), d_right.tolist(), p_left.tolist(), p_right.tolist(), expected)]


class NumberTypicalityJudge:
    """`DigitTypicalityJudge` on each half of a two-digit canvas: the mean of the two halves' p-values.

    Real digit pairs score about 0.5 on average, as real digits do under the
    digit judge; a half further from its prompted digit than any real digit
    adds 0, so a blob in one half caps the sample at 0.5.
    """

    name = "number_typicality"

    def __init__(self, digit_typicality: DigitTypicalityJudge | None = None):
        self.digit_typicality = digit_typicality or DigitTypicalityJudge()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Typicality [B] float32 of each row for its prompted number; NaN where the prompt names none."""
        pairs = prompted_number_digits(prompts, metadata)
        halves = to_digit_halves(images.detach())
        scores = [self.digit_typicality(half, [""] * len(pairs), [{"digit": None if p is None else p[side]}
                                                                  for p in pairs])
                  for side, half in enumerate(halves)]
        return (scores[0] + scores[1]) / 2

    def classes(self, prompts: list[str], metadata: list[dict]) -> list[int | None]:
        """The number each row asks for, exactly as `NumberJudge.classes` (so per-class metrics line up)."""
        return _number_classes(prompted_number_digits(prompts, metadata))


def judges_for_card(card_id: str) -> dict:
    """The evaluation judges of a model card, by metric name (the first one's verdicts frame the sample grid);
    {} for a card without judges."""
    if card_id == "toy-digits":
        # The SVC first: its verdicts frame the sample grid. Typicality sees the saturated blobs it accepts.
        return {"digit_svc": DigitJudge(), "digit_typicality": DigitTypicalityJudge()}
    if card_id == "toy-numbers":
        return {"number_svc": NumberJudge(), "number_typicality": NumberTypicalityJudge()}
    return {}
