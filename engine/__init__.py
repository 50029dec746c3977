"""flywheel's rollout engine: model cards, samplers, the device-resident denoise loop."""

from engine.cards import FlowModel, ModelCard, PromptEmbeds, get_card, list_cards, load_model, register_card
from engine.engine import Engine
from engine.guards import HostTransferError, forbid_host_transfers
from engine.types import GenerationRequest, Trajectory

__all__ = [
    "Engine", "FlowModel", "GenerationRequest", "HostTransferError", "ModelCard", "PromptEmbeds", "Trajectory",
    "forbid_host_transfers", "get_card", "list_cards", "load_model", "register_card",
]
