"""`ServedRewardScorer`: a reward model hosted as a card of an `AsyncEngine`, used as an in-process Scorer.

The engine batches this scorer's calls with every other caller of the same
card (dynamic batching, admission, the serving pool), and the card can be
replaced in the running engine (`AsyncEngine.replace_model`) without
rebuilding the scorer: the next call scores with the new model.
"""

from __future__ import annotations

import torch

from engine.async_engine import AsyncEngine


class ServedRewardScorer:
    """Scorer protocol over `async_engine.score(card_id, ...)`.

    Called from an ordinary thread, the engine must run on a background loop
    (`AsyncEngine.start_background()`); from inside an event loop use
    `await scorer.score_async(...)`.
    """

    def __init__(self, async_engine: AsyncEngine, card_id: str, name: str | None = None,
                 timeout_s: float | None = 600.0):
        async_engine.hosted(card_id, "scorer")  # fail now, listing the hosted scorers, if it is not there
        self.engine = async_engine
        self.card_id = card_id
        self.name = name or card_id
        self.timeout_s = timeout_s

    async def score_async(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Scores [B] float32 on the host."""
        scores = await self.engine.score(self.card_id, images, list(prompts), list(metadata))
        return scores.detach().float().cpu()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Scores [B] float32 (the rewards Scorer protocol)."""
        return self.engine.run_sync(self.score_async(images, prompts, metadata), self.timeout_s)
