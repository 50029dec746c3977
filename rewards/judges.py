"""Independent judges for evaluation only: never registered as rewards, so RL cannot optimise them.

A rising reward with a flat judge score is the signature of reward hacking
(the CNN reward is overconfident on noise; see CALIBRATION.md).
"""

from __future__ import annotations

import torch
from sklearn.calibration import CalibratedClassifierCV
from sklearn.svm import SVC

from rewards.digits import digit_split, prob_of_prompted, prompted_digits, to_digit_grid


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
