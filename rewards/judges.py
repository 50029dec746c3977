"""Independent judges for evaluation only: never registered as rewards, so RL cannot optimise them.

A rising reward with a flat judge score is the signature of reward hacking
(the CNN reward is overconfident on noise; see CALIBRATION.md).

A judge is called like a scorer, `judge(images, prompts, metadata) -> [B]`
scores. Two optional methods let evaluation say more:

- `classes(prompts, metadata) -> [B]` list: the class each sample belongs to
  (None for a sample in none). A task "has classes" when one of its judges
  defines this; evaluation then reports the judge and the reward per class
  (`flywheel.loop.evaluate`), which is where hacking shows first: one class
  collapsing into a blob the reward still accepts moves the overall mean little.
- `verdicts(images, prompts, metadata) -> [B]` list of `Verdict`: what the
  judge sees in each image, drawn on the sample grid (`flywheel.grids`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sklearn.calibration import CalibratedClassifierCV
from sklearn.svm import SVC

from rewards.digits import digit_split, prob_of_prompted, prompted_digits, to_digit_grid


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
