"""Model cards: what a model family is made of, and a registry by id.

A card knows how to load a `FlowModel` (its transformer, prompt encoder and
decoder) and the sampling defaults that suit it. The engine only talks to the
`FlowModel` protocol below, so the built-in toy model and diffusers families
plug in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import torch
from torch import nn


class PromptEmbeds(NamedTuple):
    """The conditioning of a batch of prompts.

    embeds [B, L, D], pooled [B, D], mask [B, L] (bool, True = real token) or None.
    extra: per-row conditioning beyond the text, batch-first tensors by name (an
    image-to-video card's first-frame latents and image embedding), or None. The
    unconditional branch of CFG gets the same extra as the conditional one.
    """

    embeds: torch.Tensor
    pooled: torch.Tensor
    mask: torch.Tensor | None
    extra: dict[str, torch.Tensor] | None = None


class FlowModel(Protocol):
    """What the engine needs of a loaded model."""

    card_id: str
    transformer: nn.Module
    # Optional: `embedded_guidance = True` for guidance-distilled models; the
    # engine then skips the unconditional branch and calls
    # velocity(..., guidance=g). Optional: `schedule(steps, latent_shape)`
    # returning the model's own flow times [T+1] from 1 to 0. Optional:
    # `ode_scheduler(steps, latent_shape)` returning a fresh diffusers scheduler
    # set for `steps` (the folder's own, e.g. Wan's UniPC) that ODE requests
    # step with instead of the engine's Euler steps, or None to keep Euler.
    # Optional: `guide(v_uncond, v_cond, guidance_scale)` combining the two CFG
    # branches when the family does not use v_u + g·(v_c - v_u) (Qwen-Image's
    # norm-rescaled true CFG, per-modality scales). Optional: `image_conditioned
    # = True` with `encode_images(paths, latent_shape) -> dict[str, Tensor]`
    # (per-row tensors put in PromptEmbeds.extra) for cards that take a
    # `GenerationRequest.image` (image-to-video, editing); such a card refuses
    # requests without one, and every other card refuses requests with one.
    # Optional with it: `prompts_read_images = True` when the text encoder reads
    # the image with the prompt (Qwen-Image-Edit): the engine then calls
    # `encode_prompts(prompts, images=paths)` per batch, bypassing its cache.

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embed prompts (an empty string is the unconditional prompt)."""

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, t: torch.Tensor,
                 cond: PromptEmbeds) -> torch.Tensor:
        """Velocity `v = eps - x0` at flow time t in [0, 1] ([B] or scalar).

        `transformer` is passed in so that a trainer can call its own wrapped
        module (DDP, FSDP, peft) with the model's conventions.
        """

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents to images [B, C, H, W] (or videos [B, C, F, H, W]) in [0, 1]."""

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """Shape of one sample's latent, given the requested output size."""


@dataclass(frozen=True)
class ModelCard:
    """A registered model family.

    `load(path, device, dtype)` returns a FlowModel; `path` is a local folder
    of weights or None for weights the project ships. The descriptive fields
    (components, latent rule, precision) are what `GET /v1/models` shows.
    """

    id: str
    description: str
    load: Callable[..., FlowModel]
    defaults: dict = field(default_factory=dict)
    # Component name -> what it is, e.g. {"prompt_encoder": "CLIP-L + T5", "transformer": ..., "decoder": "VAE"}.
    components: dict = field(default_factory=dict)
    # How the latent shape follows from the requested size, in words.
    latent_rule: str = ""
    # The dtype the transformer runs in by default; latents and log-probs stay fp32 whatever it is.
    precision: str = "float32"
    kind: str = "generator"

    def describe(self) -> dict:
        """A JSON-able summary of the card."""
        return {"id": self.id, "kind": self.kind, "description": self.description,
                "components": dict(self.components), "latent_rule": self.latent_rule,
                "precision": self.precision,
                "defaults": {k: v for k, v in self.defaults.items() if isinstance(v, (int, float, str, bool))}}


_CARDS: dict[str, ModelCard] = {}


def register_card(card: ModelCard) -> ModelCard:
    if card.id in _CARDS:
        raise ValueError(f"a model card with id {card.id!r} is already registered")
    from engine.workflows.definition import CATALOG  # cards and workflows share one namespace of ids

    if card.id in CATALOG:
        raise ValueError(f"{card.id!r} is a workflow id (engine.workflows.CATALOG); choose another card id")
    _CARDS[card.id] = card
    return card


def _ensure_builtin_cards() -> None:
    # Imported lazily so that `import engine` stays cheap and so the built-in
    # cards can import from this module.
    import engine.families  # noqa: F401
    import engine.toy.card  # noqa: F401


def get_card(card_id: str) -> ModelCard:
    _ensure_builtin_cards()
    if card_id not in _CARDS:
        raise KeyError(f"unknown model card {card_id!r}; known cards: {', '.join(sorted(_CARDS))}")
    return _CARDS[card_id]


def list_cards() -> list[str]:
    _ensure_builtin_cards()
    return sorted(_CARDS)


def load_model(card_id: str, path: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> FlowModel:
    """Load the model of a card onto a device."""
    return get_card(card_id).load(path=path, device=torch.device(device), dtype=dtype)
