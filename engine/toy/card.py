"""The `toy-digits` model card: the built-in 8x8 digits model, its loader and its registration."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.toy.model import ToyDiT, ToyDiTConfig
from engine.toy.text import ToyPromptEncoder, ToyTextConfig, ToyTokenizer

CARD_ID = "toy-digits"
SAMPLE_SIZE = 8
WEIGHTS_FILE = "toy-digits.safetensors"
DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / WEIGHTS_FILE
FORMAT = "flywheel-toy-digits-v1"


class ToyDigitsModel:
    """FlowModel of the toy digits task: the latent is the image, [1, 8, 8] in [-1, 1]."""

    card_id = CARD_ID

    def __init__(self, transformer: ToyDiT, text_encoder: ToyPromptEncoder, tokenizer: ToyTokenizer,
                 max_length: int = 16):
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.max_length = max_length

    @property
    def device(self) -> torch.device:
        """Device of the transformer's parameters."""
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the transformer's parameters."""
        return next(self.transformer.parameters()).dtype

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Embed prompts in fp32 on the model's device; "" is the unconditional prompt."""
        ids, mask = self.tokenizer(list(prompts), max_length=self.max_length)
        device = next(self.text_encoder.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            embeds, pooled = self.text_encoder(ids, mask)
        return PromptEmbeds(embeds.float().to(self.device), pooled.float().to(self.device), mask.to(self.device))

    def velocity(self, transformer, latents: torch.Tensor, t: torch.Tensor, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32) of `latents` [B, 1, 8, 8] at flow time t (scalar or [B])."""
        b = latents.shape[0]
        t = torch.as_tensor(t, dtype=torch.float32, device=latents.device).reshape(-1).expand(b)
        out = transformer(
            hidden_states=latents.to(self.dtype),
            encoder_hidden_states=cond.embeds,
            pooled_projections=cond.pooled,
            timestep=t * 1000.0,
            encoder_attention_mask=cond.mask,
        )
        return out.float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, 1, 8, 8] to images in [0, 1] (fp32); no VAE, just a rescale."""
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(1, 8, 8); any other requested size is an error."""
        if height not in (None, SAMPLE_SIZE) or width not in (None, SAMPLE_SIZE):
            raise ValueError(f"{CARD_ID} generates {SAMPLE_SIZE}x{SAMPLE_SIZE} images only; "
                             f"got height={height}, width={width} (use height={SAMPLE_SIZE}, width={SAMPLE_SIZE})")
        if frames not in (None, 1):
            raise ValueError(f"{CARD_ID} generates images, not videos; got frames={frames} (use frames=None)")
        return (1, SAMPLE_SIZE, SAMPLE_SIZE)


def weights_metadata(transformer: ToyDiT, text_encoder: ToyPromptEncoder, tokenizer: ToyTokenizer,
                     **extra) -> dict[str, str]:
    """The safetensors metadata that lets `load_toy_digits` rebuild the modules (all values strings)."""
    meta = {
        "format": FORMAT,
        "card_id": CARD_ID,
        "transformer_config": json.dumps(asdict(transformer.config)),
        "text_encoder_config": json.dumps(asdict(text_encoder.config)),
        "vocabulary": json.dumps(tokenizer.vocabulary),
    }
    meta.update({k: str(v) for k, v in extra.items()})
    return meta


def weights_state_dict(transformer: ToyDiT, text_encoder: ToyPromptEncoder) -> dict[str, torch.Tensor]:
    """Both modules' tensors under `transformer.` / `text_encoder.` prefixes, contiguous, on the CPU."""
    tensors = {}
    for prefix, module in (("transformer.", transformer), ("text_encoder.", text_encoder)):
        for name, tensor in module.state_dict().items():
            tensors[prefix + name] = tensor.detach().cpu().contiguous()
    return tensors


def _resolve(path: str | Path | None) -> Path:
    if path is None:
        return DEFAULT_WEIGHTS
    path = Path(path)
    return path / WEIGHTS_FILE if path.is_dir() else path


def load_toy_digits(path: str | Path | None = None, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> ToyDigitsModel:
    """Load the toy model from a safetensors file or folder (None: the weights the project ships)."""
    file = _resolve(path)
    if not file.is_file():
        raise FileNotFoundError(f"no {CARD_ID} weights at {file}; regenerate them with "
                                f"`python scripts/pretrain_toy_digits.py`")
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{file} is not a {CARD_ID} weights file (format={meta.get('format')!r}, expected {FORMAT!r})")
    tensors = load_file(str(file))
    transformer = ToyDiT(ToyDiTConfig(**json.loads(meta["transformer_config"])))
    text_encoder = ToyPromptEncoder(ToyTextConfig(**json.loads(meta["text_encoder_config"])))
    # The tokenizer's ids are baked into the embedding table, so its vocabulary comes from the file.
    tokenizer = ToyTokenizer(json.loads(meta["vocabulary"]))
    for prefix, module in (("transformer.", transformer), ("text_encoder.", text_encoder)):
        module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
    device = torch.device(device)
    transformer.to(device=device, dtype=dtype).eval()
    # The prompt encoder is frozen and tiny: it stays fp32 whatever the transformer's dtype.
    text_encoder.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    return ToyDigitsModel(transformer, text_encoder, tokenizer, max_length=text_encoder.config.max_length)


register_card(ModelCard(
    id=CARD_ID,
    description="Built-in toy text-to-image model: a ~250k-parameter DiT on sklearn's 8x8 digits, "
                "pretrained with 40% label noise so it follows prompts imperfectly (room for RL).",
    load=load_toy_digits,
    components={"prompt_encoder": "ToyPromptEncoder (word tokenizer, 1 attention layer, 64-d)",
                "transformer": "ToyDiT (patch 2, width 64, 3 joint-attention blocks)",
                "decoder": "identity (latents are the images, rescaled from [-1, 1])"},
    latent_rule="[1, 8, 8]: the 8x8 gray image itself",
    precision="float32 weights; fp32 latents and log-probs",
    defaults=dict(steps=10, guidance_scale=1.0, noise_level=0.7, height=8, width=8,
                  # The attention and MLP projections of every block (peft matches name suffixes).
                  lora_targets=["qkv", "proj", "mlp.0", "mlp.2"]),
))
