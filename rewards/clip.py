"""CLIP-family scorers read from a local folder: `clip_score`, `pickscore`, `aesthetic`.

Weights are never fetched: the folder is a transformers CLIP checkpoint that
the user downloaded (or converted) beforehand. Preprocessing (resize, centre
crop, normalise) runs on the scorer's device with the folder's
preprocessor_config.json values, so images never leave the device until the
scores do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

MODEL_FILES = ("config.json", "model.safetensors", "preprocessor_config.json")  # or a sharded index
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))  # either set will do
HEAD_FILE = "aesthetic_head.safetensors"


def resolve_folder(path: str | os.PathLike | None, env: str, scorer: str) -> Path:
    """The local CLIP folder from the kwarg or the env var; a clear error naming the files it must hold."""
    path = path or os.environ.get(env)
    need = (f"a transformers CLIP folder holding {', '.join(MODEL_FILES)} and the tokenizer "
            f"(tokenizer.json, or vocab.json + merges.txt)")
    if not path:
        raise FileNotFoundError(f"reward {scorer!r} needs {need}; pass path=... (scorer_kwargs) or set {env}. "
                                "Weights are never downloaded: save them there first, e.g. with "
                                "CLIPModel.from_pretrained(...).save_pretrained(folder) on a machine with access")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"reward {scorer!r}: folder {folder} does not exist; it must be {need}")
    missing = [f for f in MODEL_FILES if not (folder / f).is_file()
               and not (f == "model.safetensors" and (folder / "model.safetensors.index.json").is_file())]
    if not any(all((folder / f).is_file() for f in group) for group in TOKENIZER_FILES):
        missing.append("tokenizer.json (or vocab.json + merges.txt)")
    if missing:
        raise FileNotFoundError(f"reward {scorer!r}: folder {folder} lacks {', '.join(missing)}; it must be {need}")
    from engine.families.common import unreadable_safetensors  # a header read each: a download cut short

    broken = unreadable_safetensors(sorted(folder.glob("*.safetensors")))
    if broken:
        raise FileNotFoundError(f"reward {scorer!r}: folder {folder} has unreadable weights: {'; '.join(broken)}")
    return folder


def _pair(value, key: str) -> tuple[int, int]:
    """A preprocessor size entry (int or dict) as (height, width)."""
    if isinstance(value, int):
        return value, value
    if "height" in value:
        return value["height"], value["width"]
    return value[key], value[key]


class ClipImagePreprocess:
    """Resize the shorter side, centre-crop and normalise, as CLIPImageProcessor does, in torch."""

    def __init__(self, folder: Path):
        cfg = json.loads((folder / "preprocessor_config.json").read_text())
        self.short = _pair(cfg.get("size", 224), "shortest_edge")[0]
        self.crop = _pair(cfg.get("crop_size", self.short), "height")
        self.mean = torch.tensor(cfg.get("image_mean", [0.48145466, 0.4578275, 0.40821073])).view(1, 3, 1, 1)
        self.std = torch.tensor(cfg.get("image_std", [0.26862954, 0.26130258, 0.27577711])).view(1, 3, 1, 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W] in [0, 1] (C = 1 or 3) -> pixel_values [B, 3, crop_h, crop_w]."""
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"expected images [B, C, H, W] with C in (1, 3), got shape {tuple(images.shape)}")
        x = images.float().clamp(0, 1)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        h, w = x.shape[-2:]
        scale = self.short / min(h, w)
        size = (max(self.crop[0], round(h * scale)), max(self.crop[1], round(w * scale)))
        x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
        top, left = (size[0] - self.crop[0]) // 2, (size[1] - self.crop[1]) // 2
        x = x[..., top:top + self.crop[0], left:left + self.crop[1]]
        return (x - self.mean.to(x.device)) / self.std.to(x.device)


class _ClipBase:
    """A CLIPModel, its tokenizer and preprocessing, loaded once from a local folder."""

    env = "FLYWHEEL_CLIP_PATH"
    name = "clip"

    def __init__(self, path: str | os.PathLike | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32):
        from transformers import AutoTokenizer, CLIPModel

        self.folder = resolve_folder(path, self.env, self.name)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = CLIPModel.from_pretrained(self.folder, local_files_only=True, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        self.preprocess = ClipImagePreprocess(self.folder)
        self.dtype = dtype

    @classmethod
    def check_args(cls, path: str | os.PathLike | None = None, **_) -> None:
        """Raise FileNotFoundError, as the constructor would, when the folder is missing or incomplete; loads
        nothing (`rewards.registry.check_scorer`)."""
        resolve_folder(path, cls.env, cls.name)

    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised image embeddings [B, D] (a graph only when the images require grad: the model is
        frozen, so reward-gradient recipes can backpropagate into the pixels)."""
        pixels = self.preprocess(images.to(self.device)).to(self.dtype)
        return F.normalize(_features(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """L2-normalised text embeddings [B, D]."""
        max_len = self.model.config.text_config.max_position_embeddings
        tokens = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=max_len,
                                return_tensors="pt").to(self.device)
        feats = self.model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        return F.normalize(_features(feats).float(), dim=-1)


def _features(out) -> torch.Tensor:
    """get_*_features returns a tensor, or (in newer transformers) an output holding the pooled projection."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("image_embeds", "text_embeds", "pooler_output"):
        value = getattr(out, key, None)
        if value is not None:
            return value
    raise TypeError(f"unexpected CLIP feature output {type(out).__name__}")


class ClipScore(_ClipBase):
    """Scorer: cosine similarity of CLIP image and prompt embeddings (in [-1, 1])."""

    env = "FLYWHEEL_CLIP_PATH"
    name = "clip_score"
    output_range = (-1.0, 1.0)  # a cosine
    differentiable = True

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        return (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1).cpu()


class PickScore(_ClipBase):
    """Scorer: PickScore, exp(logit_scale) x cosine similarity, from a local PickScore_v1 CLIP folder."""

    env = "FLYWHEEL_PICKSCORE_PATH"
    name = "pickscore"
    differentiable = True

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host (about 20-23 for real PickScore on good images)."""
        cos = (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1)
        return (self.model.logit_scale.exp().float() * cos).cpu()


def load_head(path: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The aesthetic head's linear layers, in order of the index in their keys `layers.N.weight/bias`."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    indices = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("layers.") and k.endswith(".weight")})
    if not indices:
        raise ValueError(f"{path} holds no 'layers.N.weight' tensors; found {sorted(tensors)[:8]}")
    layers = []
    for i in indices:
        weight, bias = tensors[f"layers.{i}.weight"], tensors.get(f"layers.{i}.bias")
        layers.append((weight.float(), bias.float() if bias is not None else torch.zeros(weight.shape[0])))
    for (w0, _), (w1, _) in zip(layers, layers[1:]):
        if w1.shape[1] != w0.shape[0]:
            raise ValueError(f"{path}: layer shapes do not chain ({tuple(w0.shape)} then {tuple(w1.shape)})")
    if layers[-1][0].shape[0] != 1:
        raise ValueError(f"{path}: the last layer must have one output, got {layers[-1][0].shape[0]}")
    return layers


class Aesthetic(_ClipBase):
    """Scorer: a linear or MLP head on the L2-normalised CLIP image embedding (LAION aesthetic style).

    The head is `aesthetic_head.safetensors` in the CLIP folder (or `head=`):
    linear layers `layers.N.weight` / `layers.N.bias` applied in order of N
    with no activation between them, which is the LAION predictor's layout, so
    its state dict converts key for key (its dropout indices are simply absent).
    """

    env = "FLYWHEEL_AESTHETIC_PATH"
    name = "aesthetic"
    differentiable = True

    def __init__(self, path: str | os.PathLike | None = None, head: str | os.PathLike | None = None, **kwargs):
        super().__init__(path, **kwargs)
        head_path = _head_path(self.folder, head)
        self.layers = [(w.to(self.device), b.to(self.device)) for w, b in load_head(head_path)]
        dim = self.model.config.projection_dim
        if self.layers[0][0].shape[1] != dim:
            raise ValueError(f"{head_path}: first layer expects {self.layers[0][0].shape[1]} inputs but the CLIP "
                             f"model's embedding has {dim}")

    @classmethod
    def check_args(cls, path: str | os.PathLike | None = None, head: str | os.PathLike | None = None, **_) -> None:
        """The CLIP folder and the head file, checked without loading either."""
        _head_path(resolve_folder(path, cls.env, cls.name), head)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host."""
        x = self.image_embeds(images)
        for weight, bias in self.layers:
            x = F.linear(x, weight, bias)
        return x[:, 0].cpu()


def _head_path(folder: Path, head: str | os.PathLike | None) -> Path:
    """The aesthetic head file (`head`, or the CLIP folder's), which must exist."""
    head_path = Path(head) if head else folder / HEAD_FILE
    if not head_path.is_file():
        raise FileNotFoundError(f"reward 'aesthetic': head file {head_path} does not exist; it must be a "
                                f"safetensors file of linear layers 'layers.N.weight' / 'layers.N.bias' "
                                f"(put it in the CLIP folder as {HEAD_FILE} or pass head=...)")
    from engine.families.common import unreadable_safetensors

    broken = unreadable_safetensors([head_path])
    if broken:
        raise FileNotFoundError(f"reward 'aesthetic': head file {head_path} is unreadable: {broken[0]}")
    return head_path
