"""`ServedRewardScorer`: a reward model hosted as a card of an `AsyncEngine`, used as an in-process Scorer.

The engine batches this scorer's calls with every other caller of the same
card (dynamic batching, admission, the serving pool), and the card can be
replaced in the running engine (`AsyncEngine.replace_model`) without
rebuilding the scorer: the next call scores with the new model.
"""

from __future__ import annotations

import torch

from engine.async_engine import AsyncEngine
from rewards.remote import check_seconds


class ServedRewardScorer:
    """Scorer protocol over `async_engine.score(card_id, ...)`.

    Called from an ordinary thread, the engine must run on a background loop
    (`AsyncEngine.start_background()`); from inside an event loop use
    `await scorer.score_async(...)`.
    """

    def __init__(self, async_engine: AsyncEngine, card_id: str, name: str | None = None,
                 timeout_s: float = 600.0):
        """`timeout_s`: the wall-clock bound of one call (a number of seconds in (0, a week]: every wait of a
        scorer is bounded, so a stuck engine masks the batch rather than hanging the run)."""
        self.timeout_s = check_seconds("timeout_s", timeout_s)  # before anything: 0, NaN or None is refused
        async_engine.hosted(card_id, "scorer")  # fail now, listing the hosted scorers, if it is not there
        self.engine = async_engine
        self.card_id = card_id
        self.name = name or card_id

    async def score_async(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Scores [B] float32 on the host."""
        scores = await self.engine.score(self.card_id, images, list(prompts), list(metadata))
        return scores.detach().float().cpu()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Scores [B] float32 (the rewards Scorer protocol)."""
        try:
            return self.engine.run_sync(self.score_async(images, prompts, metadata), self.timeout_s)
        except TimeoutError as exc:  # inside a RewardSet the batch is masked, with this as the reason
            raise TimeoutError(f"served reward {self.name!r} (card {self.card_id!r}) did not score a batch of "
                               f"{len(prompts)} within timeout_s={self.timeout_s:g}: {exc}") from None
