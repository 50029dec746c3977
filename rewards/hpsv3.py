"""`hpsv3`: HPSv3 (human preference score v3), a Qwen2-VL backbone with a reward head, read from a local folder.

HPSv3 (MizzenAI, ICCV 2025) asks Qwen2-VL-7B-Instruct to rate an image against
its prompt and reads the answer off the last hidden state at a special
`<|Reward|>` token through a small MLP head: Linear(hidden, 1024), ReLU,
(dropout), Linear(1024, 16), ReLU, Linear(16, 2). The head's two outputs are
the mean and the uncertainty of the preference; the score is the mean (HPSv3
reports about 5-15 for typical generated images). Images are resized to a
fixed pixel count (256·28·28 in HPSv3) with Qwen2-VL's own image processor.

The folder (kwarg `path` or $FLYWHEEL_HPSV3_PATH) holds:
- a transformers Qwen2-VL checkpoint (`config.json`, `model.safetensors` or its
  index) whose vocabulary includes `<|Reward|>`, saved with save_pretrained;
- the processor (tokenizer and `preprocessor_config.json`), saved likewise;
- `rm_head.safetensors`: the head's linear layers as `rm_head.N.weight` /
  `rm_head.N.bias` (N = 0, 3, 5 in HPSv3's layout; ReLU between them).
The official HPSv3.safetensors holds all three in one state dict (`rm_head.*`
beside the Qwen2-VL weights): split it once on a machine with the weights.
Weights are never downloaded here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

ENV = "FLYWHEEL_HPSV3_PATH"
HEAD_FILE = "rm_head.safetensors"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # HPSv3 resizes every image to this many pixels (min = max)
INSTRUCTION = ("\nYou are tasked with evaluating a generated image based on Visual Quality and Text Alignment and "
               "give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 "
               "being the worst and 10 being the best.\n\nTextual prompt - {prompt}\n\n\n")
ASK = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
# Qwen2-VL's chat template for one user turn of an image then text, with its default system message.
CHAT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n")


def resolve_folder(path: str | os.PathLike | None) -> Path:
    """The HPSv3 folder from the kwarg or $FLYWHEEL_HPSV3_PATH; a clear error naming what it must hold."""
    need = (f"a transformers Qwen2-VL folder (config.json, model.safetensors, tokenizer with {REWARD_TOKEN}, "
            f"preprocessor_config.json) with the reward head in {HEAD_FILE}")
    path = path or os.environ.get(ENV)
    if not path:
        raise FileNotFoundError(f"reward 'hpsv3' needs {need}; pass path=... or set {ENV}. Weights are never "
                                "downloaded: save them there first")
    folder = Path(path).expanduser()
    missing = [f for f in ("config.json", "preprocessor_config.json", HEAD_FILE) if not (folder / f).is_file()]
    if not (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").is_file():
        missing.append("model.safetensors")
    if missing:
        raise FileNotFoundError(f"reward 'hpsv3': folder {folder} lacks {', '.join(missing)}; it must be {need}")
    from engine.families.common import unreadable_safetensors  # a header read each: a download cut short

    broken = unreadable_safetensors(sorted(folder.glob("*.safetensors")))
    if broken:
        raise FileNotFoundError(f"reward 'hpsv3': folder {folder} has unreadable weights: {'; '.join(broken)}")
    return folder


def load_head(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The head's linear layers `rm_head.N.weight/bias`, in order of N; the last one has 2 outputs (mu, sigma)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    indices = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("rm_head.") and k.endswith(".weight")})
    if not indices:
        raise ValueError(f"{path} holds no 'rm_head.N.weight' tensors; found {sorted(tensors)[:8]}")
    layers = [(tensors[f"rm_head.{i}.weight"].float(), tensors[f"rm_head.{i}.bias"].float()) for i in indices]
    for (w0, _), (w1, _) in zip(layers, layers[1:]):
        if w1.shape[1] != w0.shape[0]:
            raise ValueError(f"{path}: head layer shapes do not chain ({tuple(w0.shape)} then {tuple(w1.shape)})")
    if layers[-1][0].shape[0] != 2:
        raise ValueError(f"{path}: the head's last layer must have 2 outputs (mu, sigma), got {layers[-1][0].shape[0]}")
    return layers


class HPSv3:
    """Scorer: HPSv3's preference mean for each (image, prompt), in its own units (higher is preferred)."""

    name = "hpsv3"

    @staticmethod
    def check_args(path: str | os.PathLike | None = None, pixels: int = PIXELS, batch_size: int = 8, **_) -> Path:
        """What the constructor refuses, found without loading anything (`rewards.registry.check_scorer`, run
        before a training run writes its directory): the folder's files and the two numbers. The folder."""
        folder = resolve_folder(path)
        if isinstance(pixels, bool) or not isinstance(pixels, int) or pixels < 4 * 28 * 28:
            raise ValueError(f"hpsv3 pixels must be an integer >= {4 * 28 * 28} (Qwen2-VL's minimum), got {pixels!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"hpsv3 batch_size must be an integer >= 1, got {batch_size!r}")
        return folder

    def __init__(self, path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32, pixels: int = PIXELS, batch_size: int = 8):
        from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.folder = self.check_args(path, pixels=pixels, batch_size=batch_size)
        self.device, self.pixels, self.batch_size = torch.device(device), pixels, batch_size
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        # The tokenizer and the image processor, not Qwen2VLProcessor: in transformers 5 that one also wants a
        # video processor, which needs torchvision. Right padding: the reward token's causal hidden state then
        # never sees the padding.
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.folder), padding_side="right")
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(self.folder))
        self.reward_id = self.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        if self.reward_id is None or self.reward_id == self.tokenizer.unk_token_id:
            raise ValueError(f"reward 'hpsv3': the tokenizer in {self.folder} has no {REWARD_TOKEN} token")
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(str(self.folder), dtype=self.dtype)
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        self.layers = [(w.to(self.device), b.to(self.device)) for w, b in load_head(self.folder / HEAD_FILE)]
        hidden = self.model.config.text_config.hidden_size
        if self.layers[0][0].shape[1] != hidden:
            raise ValueError(f"{self.folder / HEAD_FILE}: the head expects {self.layers[0][0].shape[1]} inputs but "
                             f"the backbone's hidden size is {hidden}")

    def inputs(self, images: torch.Tensor, prompts: list[str]) -> dict:
        """The model's inputs: chat texts with the image's tokens, images resized to `pixels` pixels."""
        from PIL import Image

        x = torch.nan_to_num(images.detach().float().cpu(), nan=0.0).clamp(0, 1)
        if x.dim() != 4 or x.shape[1] not in (1, 3):
            raise ValueError(f"hpsv3 expects images [B, C, H, W] with C in (1, 3), got {tuple(images.shape)}")
        pil = [Image.fromarray((im.expand(3, -1, -1) * 255).round().byte().permute(1, 2, 0).numpy(), "RGB")
               for im in x]
        vision = self.image_processor(images=pil, return_tensors="pt", min_pixels=self.pixels, max_pixels=self.pixels)
        merge = self.model.config.vision_config.spatial_merge_size ** 2
        texts = []
        for prompt, grid in zip(prompts, vision["image_grid_thw"]):
            # Qwen2-VL's processor step: one <|image_pad|> per merged patch of the image.
            pads = "<|image_pad|>" * (int(grid.prod()) // merge)
            texts.append(CHAT.format(text=INSTRUCTION.format(prompt=prompt) + ASK).replace("<|image_pad|>", pads))
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        # M-RoPE's modality of each token: 1 for image tokens, 0 for text (as the processor returns it).
        modality = (tokens["input_ids"] == self.model.config.image_token_id).long()
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
                "mm_token_type_ids": modality,
                "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(mu, sigma) [B, 2] from hidden states [B, H] at the reward token."""
        x = hidden.float()
        for i, (weight, bias) in enumerate(self.layers):
            x = F.linear(x, weight, bias)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host: the head's mu."""
        out = []
        for start in range(0, len(prompts), self.batch_size):
            batch = self.inputs(images[start:start + self.batch_size], prompts[start:start + self.batch_size])
            batch = {k: v.to(self.device) for k, v in batch.items()}
            hidden = self.model.model(**batch).last_hidden_state  # [b, T, H]
            is_reward = batch["input_ids"] == self.reward_id
            if not bool(is_reward.any(1).all()):
                raise RuntimeError(f"hpsv3: a row lost its {REWARD_TOKEN} token (truncated?)")
            # The last reward token of each row (the prompt could spell one too).
            last = (is_reward * torch.arange(is_reward.shape[1], device=self.device)).argmax(1)
            out.append(self.head(hidden[torch.arange(hidden.shape[0], device=self.device), last])[:, 0].cpu())
        return torch.cat(out).float()
