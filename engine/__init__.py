"""flywheel's rollout engine: model cards, samplers, the device-resident denoise loop, serving."""

from engine.admission import AdmissionController, AdmissionError
from engine.async_engine import AsyncEngine, UnknownCardError
from engine.cards import FlowModel, ModelCard, PromptEmbeds, get_card, list_cards, load_model, register_card
from engine.compare import compare_outputs
from engine.engine import Engine
from engine.guards import HostTransferError, forbid_host_transfers
from engine.types import SAMPLERS, GenerationRequest, Trajectory

__all__ = [
    "SAMPLERS", "AdmissionController", "AdmissionError", "AsyncEngine", "Engine", "FlowModel", "GenerationRequest",
    "HostTransferError", "ModelCard", "PromptEmbeds", "Trajectory", "UnknownCardError", "compare_outputs",
    "forbid_host_transfers", "get_card", "list_cards", "load_model", "register_card",
]
