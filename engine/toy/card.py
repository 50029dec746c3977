"""The built-in toy cards, `toy-digits` (8x8) and `toy-numbers` (8x16): one model class, one loader, two specs.

Both cards are the same family (ToyDiT + ToyPromptEncoder on gray latents that
are the images themselves); a `ToyCardSpec` says what differs: the canvas,
the shipped weights file, the prompt grammar, and the script that made them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.toy.model import ToyDiT, ToyDiTConfig
from engine.toy.text import ToyPromptEncoder, ToyTextConfig, ToyTokenizer

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


@dataclass(frozen=True)
class ToyCardSpec:
    """What one toy card fixes: id, canvas, weights file and its format tag, how to regenerate it."""

    card_id: str
    height: int
    width: int
    weights_file: str
    format: str
    script: str  # the command that writes the shipped weights

    @property
    def default_weights(self) -> Path:
        """The weights the project ships for this card."""
        return WEIGHTS_DIR / self.weights_file


DIGITS = ToyCardSpec("toy-digits", 8, 8, "toy-digits.safetensors", "flywheel-toy-digits-v1",
                     "python scripts/pretrain_toy_digits.py")
NUMBERS = ToyCardSpec("toy-numbers", 8, 16, "toy-numbers.safetensors", "flywheel-toy-numbers-v1",
                      "python scripts/pretrain_toy_numbers.py")
SPECS = {spec.card_id: spec for spec in (DIGITS, NUMBERS)}

# toy-digits' names from before toy-numbers, kept for callers.
CARD_ID = DIGITS.card_id
SAMPLE_SIZE = DIGITS.height
WEIGHTS_FILE = DIGITS.weights_file
DEFAULT_WEIGHTS = DIGITS.default_weights
FORMAT = DIGITS.format


class ToyModel:
    """FlowModel of a toy card: the latent is the gray image, [1, H, W] in [-1, 1]."""

    def __init__(self, spec: ToyCardSpec, transformer: ToyDiT, text_encoder: ToyPromptEncoder,
                 tokenizer: ToyTokenizer, max_length: int = 16):
        self.spec = spec
        self.card_id = spec.card_id
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
        """Velocity (fp32) of `latents` [B, 1, H, W] at flow time t (scalar or [B])."""
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
        """Latents [B, 1, H, W] to images in [0, 1] (fp32); no VAE, just a rescale."""
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 1, H, W] in [0, 1] to latents: the inverse of `decode` (an image-to-image stage's start)."""
        return images.float() * 2.0 - 1.0

    def latent_shape(self, height: int | None, width: int | None, frames: int | None) -> tuple[int, ...]:
        """(1, H, W) of the card's canvas; any other requested size is an error."""
        h, w = self.spec.height, self.spec.width
        if height not in (None, h) or width not in (None, w):
            raise ValueError(f"{self.card_id} generates {h}x{w} images only (height x width); "
                             f"got height={height}, width={width} (use height={h}, width={w})")
        if frames not in (None, 1):
            raise ValueError(f"{self.card_id} generates images, not videos; got frames={frames} (use frames=None)")
        return (1, h, w)


def weights_metadata(transformer: ToyDiT, text_encoder: ToyPromptEncoder, tokenizer: ToyTokenizer,
                     spec: ToyCardSpec = DIGITS, **extra) -> dict[str, str]:
    """The safetensors metadata that lets `load_toy` rebuild the modules (all values strings)."""
    meta = {
        "format": spec.format,
        "card_id": spec.card_id,
        "transformer_config": json.dumps(asdict(transformer.config)),
        "text_encoder_config": json.dumps(asdict(text_encoder.config)),
        "vocabulary": json.dumps(tokenizer.vocabulary),
    }
    if tokenizer.numerals_apart:  # absent means False: toy-digits files written before the option stay valid
        meta["numerals_apart"] = "true"
    meta.update({k: str(v) for k, v in extra.items()})
    return meta


def weights_state_dict(transformer: ToyDiT, text_encoder: ToyPromptEncoder) -> dict[str, torch.Tensor]:
    """Both modules' tensors under `transformer.` / `text_encoder.` prefixes, contiguous, on the CPU."""
    tensors = {}
    for prefix, module in (("transformer.", transformer), ("text_encoder.", text_encoder)):
        for name, tensor in module.state_dict().items():
            tensors[prefix + name] = tensor.detach().cpu().contiguous()
    return tensors


def weights_path(spec: ToyCardSpec, path: str | Path | None) -> Path:
    """The weights file a toy card loads: the shipped one for None, `<folder>/<weights_file>` for a folder."""
    if path is None:
        return spec.default_weights
    path = Path(path)
    return path / spec.weights_file if path.is_dir() else path


def weights_file_problem(spec: ToyCardSpec, file: Path) -> str | None:
    """Why `file` is not a readable weights file of the card, from its header alone, or None."""
    from engine.families.common import safetensors_problem

    problem = safetensors_problem(file)
    if problem is not None:
        return problem
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != spec.format:
        owner = [other.card_id for other in SPECS.values() if other.format == meta.get("format")]
        return (f"not a {spec.card_id} weights file (format={meta.get('format')!r}, expected {spec.format!r})"
                + (f"; it is a weights file of card {owner[0]!r}" if owner else ""))
    return None


def load_toy(spec: ToyCardSpec, path: str | Path | None = None, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> ToyModel:
    """Load a toy card's model from a safetensors file or folder (None: the weights the project ships)."""
    file = weights_path(spec, path)
    if not file.is_file():
        raise FileNotFoundError(f"no {spec.card_id} weights at {file}; regenerate them with `{spec.script}`")
    problem = weights_file_problem(spec, file)
    if problem is not None:
        raise ValueError(f"{file}: {problem}")
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    tensors = load_file(str(file))
    transformer = ToyDiT(ToyDiTConfig(**json.loads(meta["transformer_config"])))
    text_encoder = ToyPromptEncoder(ToyTextConfig(**json.loads(meta["text_encoder_config"])))
    # The tokenizer's ids are baked into the embedding table, so its vocabulary comes from the file.
    tokenizer = ToyTokenizer(json.loads(meta["vocabulary"]), numerals_apart=meta.get("numerals_apart") == "true")
    for prefix, module in (("transformer.", transformer), ("text_encoder.", text_encoder)):
        module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
    device = torch.device(device)
    transformer.to(device=device, dtype=dtype).eval()
    # The prompt encoder is frozen and tiny: it stays fp32 whatever the transformer's dtype.
    text_encoder.to(device=device, dtype=torch.float32).eval().requires_grad_(False)
    return ToyModel(spec, transformer, text_encoder, tokenizer, max_length=text_encoder.config.max_length)


load_toy_digits = functools.partial(load_toy, DIGITS)
load_toy_numbers = functools.partial(load_toy, NUMBERS)

_COMPONENTS = {"prompt_encoder": "ToyPromptEncoder (word tokenizer, 1 attention layer, 64-d)",
               "transformer": "ToyDiT (patch 2, width 64, 3 joint-attention blocks)",
               "decoder": "identity (latents are the images, rescaled from [-1, 1])"}


def _defaults(spec: ToyCardSpec) -> dict:
    return dict(steps=10, guidance_scale=1.0, noise_level=0.7, height=spec.height, width=spec.width,
                # The attention and MLP projections of every block (peft matches name suffixes).
                lora_targets=["qkv", "proj", "mlp.0", "mlp.2"])


register_card(ModelCard(
    id=DIGITS.card_id,
    description="Built-in toy text-to-image model: a ~250k-parameter DiT on sklearn's 8x8 digits, "
                "pretrained with 40% label noise so it follows prompts imperfectly (room for RL).",
    load=load_toy_digits,
    components=_COMPONENTS,
    latent_rule="[1, 8, 8]: the 8x8 gray image itself",
    precision="float32 weights; fp32 latents and log-probs",
    defaults=_defaults(DIGITS),
))

register_card(ModelCard(
    id=NUMBERS.card_id,
    description="Built-in toy text-to-image model, harder: two-digit numbers 10-99 as two of sklearn's 8x8 "
                "digits side by side, prompted in numerals and words; the toy-digits DiT family on an 8x16 "
                "canvas (patch 4), pretrained with 40% label noise on the digit images so it draws often "
                "wrong digits (room for RL).",
    load=load_toy_numbers,
    components={"prompt_encoder": "ToyPromptEncoder (word tokenizer reading numerals digit by digit, "
                                  "1 attention layer, 64-d)",
                "transformer": "ToyDiT (patch 4, width 64, 3 joint-attention blocks)",
                "decoder": _COMPONENTS["decoder"]},
    latent_rule="[1, 8, 16]: the 8x16 gray image itself (tens digit left, units digit right)",
    precision="float32 weights; fp32 latents and log-probs",
    defaults=_defaults(NUMBERS),
))
