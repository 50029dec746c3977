"""The `wan2.1-i2v` card: Wan2.1 image-to-video (`WanImageToVideoPipeline`), conditioned on a first frame.

Why Wan2.1 I2V and not Wan2.2 TI2V-5B (both load with WanImageToVideoPipeline):
Wan2.1 conditions by concatenation. The first frame, VAE-encoded and padded
with zero frames, plus a 4-channel mask marking it, are concatenated to the
noisy latents on the channels (16 + 4 + 16 = 36 inputs), and a CLIP vision
embedding of the image enters an extra cross-attention. The noisy latents
themselves follow the plain flow `x_t = (1 - t)·x0 + t·ε` at one timestep
per sample, exactly as the T2V card's, so the engine's Flow-SDE steps, their
log-probs and the training forwards need nothing new: the conditioning is a
per-row input (`PromptEmbeds.extra`) and the stock pipeline's ODE is
reproduced with no change to the engine. Wan2.2 TI2V (`expand_timesteps`)
instead overwrites the first latent frame with the image after every step
and gives its tokens timestep 0: the engine would need a per-token timestep
and a final-frame replacement, and the overwritten frame's SDE noise would
enter the log-probs without depending on the policy. It also needs the 48-
channel Wan2.2 VAE, where Wan2.1 shares the T2V card's 16-channel one (and
its tiny test folder's shape). The cost: Wan2.1 I2V exists only at 14B (480P
and 720P folders, ~16B parameters with the image cross-attention).

Conditioning (`encode_images(paths, latent_shape)`, run once per batch, no
gradient): each image is loaded with diffusers' `load_image` (EXIF rotation,
RGB), resized to the request's height x width by the pipeline's own
`video_processor` (a plain resize, as the pipeline does: the aspect ratio is
not kept), and
- `condition` [B, 20, F', H/8, W/8]: the mask (1 on the first latent frame,
  which holds the image; 0 after) and the VAE latents (mode of the posterior)
  of the image followed by F - 1 black frames, normalised as the pipeline does;
- `image_embeds` [B, 257, 1280] (real size): the CLIP vision tower's
  penultimate hidden states, through the pipeline's own `encode_image`.
Each distinct path is encoded once per batch (a GRPO group shares its image).
The velocity reads both from `cond.extra`; the unconditional CFG branch gets
the same image (only the text is dropped), as in the pipeline.

Prompts: the UMT5 embeddings of `WanPipeline` (512 tokens, zero past each
prompt). `WanImageToVideoPipeline.encode_prompt` calls ftfy unconditionally
(diffusers 0.42.1), `WanPipeline`'s only when ftfy is installed; they are
otherwise the same, so the card encodes with `WanPipeline`'s and needs no
ftfy. The transformer splits its context into image and text tokens by
assuming 512 text tokens, so a tokenizer that declares fewer is refused.

Not supported (refused at load with the reason): Wan2.2 folders (two
transformers with `boundary_ratio`, or `expand_timesteps`) and the
first-last-frame variant (FLF2V: `pos_embed_seq_len`, two images).
"""

from __future__ import annotations

import torch

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.families.common import check_diffusers_folder, flow_time_to_batch, prepare_pipeline, read_json
from engine.families.wan import WanModel

CARD_ID = "wan2.1-i2v"
PIPELINE = "WanImageToVideoPipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler", "text_encoder": "model",
              "tokenizer": "tokenizer", "image_encoder": "model", "image_processor": "processor"}
TEXT_TOKENS = 512  # diffusers' WanAttnProcessor takes the last 512 context tokens as text
LORA_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                # the image cross-attention's own keys and values: how the first frame's embedding is read
                "attn2.add_k_proj", "attn2.add_v_proj"]


class WanI2VModel(WanModel):
    """FlowModel of Wan2.1 I2V: video latents [B, 16, F', H', W'] conditioned on a first frame."""

    card_id = CARD_ID
    image_conditioned = True

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict):
        super().__init__(pipe, dtype, scheduler_config, max_sequence_length=TEXT_TOKENS)
        if self.max_sequence_length != TEXT_TOKENS:
            raise ValueError(f"{CARD_ID}: the tokenizer declares model_max_length={self.max_sequence_length}, but "
                             f"the Wan I2V transformer needs {TEXT_TOKENS} text tokens (it splits image from text "
                             f"tokens there); use the folder's UMT5 tokenizer")

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """UMT5 embeddings [B, 512, D] zero-padded past each prompt (fp32), by WanPipeline's encoder (no ftfy)."""
        from diffusers.pipelines.wan.pipeline_wan import WanPipeline

        embeds = WanPipeline._get_t5_prompt_embeds(self.pipe, prompt=list(prompts),
                                                   max_sequence_length=self.max_sequence_length, device=self.device)
        embeds = embeds.float()
        return PromptEmbeds(embeds, embeds.new_zeros(embeds.shape[0], 0), None)

    def encode_images(self, paths: list[str], latent_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Per-row first-frame conditioning: {"condition": [B, 20, F', h, w], "image_embeds": [B, L, D]} (fp32)."""
        distinct = list(dict.fromkeys(paths))
        row_of = {path: i for i, path in enumerate(distinct)}
        images = [load_first_frame(path) for path in distinct]
        frames = (latent_shape[1] - 1) * self.temporal_scale + 1
        height, width = latent_shape[2] * self.spatial_scale, latent_shape[3] * self.spatial_scale
        embeds = self.pipe.encode_image(images, self.device).float()
        # One image at a time through the VAE: its peak memory is that of one video, whatever the batch.
        latents = torch.cat([self._first_frame_latents(image, frames, height, width) for image in images])
        mask = latents.new_zeros(latents.shape[0], self.temporal_scale, *latents.shape[2:])
        mask[:, :, 0] = 1.0  # the first latent frame holds the given image (its 4 pixel frames); the rest is free
        index = torch.tensor([row_of[path] for path in paths], device=latents.device)
        return {"condition": torch.cat([mask, latents], dim=1).index_select(0, index),
                "image_embeds": embeds.index_select(0, index.to(embeds.device))}

    def _first_frame_latents(self, image, frames: int, height: int, width: int) -> torch.Tensor:
        """VAE latents [1, 16, F', h, w] (fp32, normalised) of the image followed by `frames - 1` black frames."""
        pixels = self.pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        video = torch.cat([pixels.unsqueeze(2), pixels.new_zeros(1, 3, frames - 1, height, width)], dim=2)
        posterior = self.vae.encode(video.to(self.vae.dtype)).latent_dist
        mean, std = self._mean.to(self.device), self._std.to(self.device)
        # (z - mean) times 1/std, not divided by std: the pipeline's own arithmetic, so the rounding agrees too.
        return (posterior.mode().float() - mean) * (1.0 / std)

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32) of the noisy latents, given the first-frame condition and image embedding."""
        if cond.extra is None or not {"condition", "image_embeds"} <= set(cond.extra):
            got = None if cond.extra is None else sorted(cond.extra)
            raise ValueError(f"{CARD_ID}: the conditioning has no first frame (PromptEmbeds.extra needs 'condition' "
                             f"and 'image_embeds' from encode_images); got extra={got}")
        timestep = flow_time_to_batch(t, latents.shape[0], latents.device) * 1000.0
        hidden = torch.cat([latents, cond.extra["condition"].to(latents.dtype)], dim=1)
        out = transformer(hidden_states=hidden.to(self.dtype), timestep=timestep,
                          encoder_hidden_states=cond.embeds.to(self.dtype),
                          encoder_hidden_states_image=cond.extra["image_embeds"].to(self.dtype),
                          return_dict=False)[0]
        return out.float()

def load_first_frame(path: str):
    """The RGB PIL image at a local path (EXIF rotation applied, as diffusers' load_image does)."""
    from pathlib import Path

    from diffusers.utils import load_image

    if not Path(path).is_file():
        raise FileNotFoundError(f"{CARD_ID}: the first-frame image {path!r} does not exist (GenerationRequest.image "
                                f"must be a local image file)")
    try:
        return load_image(str(path))
    except Exception as e:  # PIL raises several kinds for a file that is not an image
        raise ValueError(f"{CARD_ID}: cannot read the first-frame image {path!r} as an image ({e})") from None


def check_wan21_i2v_folder(root) -> None:
    """Refuse, with the reason, folders of the Wan I2V variants this card does not implement."""
    index = read_json(root / "model_index.json")
    if index.get("_class_name") not in (None, PIPELINE):
        raise ValueError(f"{CARD_ID}: {root} holds a {index['_class_name']} folder; this card loads a {PIPELINE} "
                         f"folder (Wan2.1-I2V-14B-480P/720P-Diffusers)")
    if index.get("boundary_ratio") is not None or index.get("expand_timesteps") \
            or (index.get("transformer_2") or [None])[0] is not None:
        raise ValueError(f"{CARD_ID}: {root} is a Wan2.2 I2V/TI2V folder (two transformers or expand_timesteps); "
                         f"this card implements Wan2.1 I2V only (one transformer, CLIP image embedding)")
    transformer = read_json(root / "transformer" / "config.json")
    if transformer.get("image_dim") is None:
        raise ValueError(f"{CARD_ID}: the transformer in {root} takes no image embedding (image_dim is null); "
                         f"Wan2.1 I2V's does (image_dim 1280)")
    if transformer.get("pos_embed_seq_len") is not None:
        raise ValueError(f"{CARD_ID}: {root} is a first-last-frame (FLF2V) folder (pos_embed_seq_len is set); "
                         f"this card conditions on a first frame only")


def load_wan_i2v(path, device: torch.device, dtype: torch.dtype) -> WanI2VModel:
    """Load Wan2.1 I2V from a local diffusers folder (every component in `dtype`)."""
    root = check_diffusers_folder(path, CARD_ID, COMPONENTS)
    check_wan21_i2v_folder(root)
    import diffusers

    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(str(root), dtype=dtype, local_files_only=True)
    pipe = prepare_pipeline(pipe, torch.device(device))
    return WanI2VModel(pipe, dtype, read_json(root / "scheduler" / "scheduler_config.json"))


register_card(ModelCard(
    id=CARD_ID,
    description="Wan2.1 image-to-video (UMT5 + CLIP image encoder + 3D DiT + causal video VAE) from a local "
                "diffusers folder; each request gives its first frame (GenerationRequest.image); outputs videos "
                "[B, C, F, H, W].",
    load=load_wan_i2v,
    defaults=dict(steps=10, guidance_scale=5.0, noise_level=0.7, height=480, width=832, frames=33,
                  lora_targets=LORA_TARGETS, diffusers_pipeline=PIPELINE, video=True,
                  # every request (and every prompt dataset row) must give a first frame: a config check can
                  # read this without loading the model
                  image_conditioned=True),
    components={"prompt_encoder": "UMT5-XXL", "image_encoder": "CLIP ViT-H/14 (penultimate layer)",
                "transformer": "WanTransformer3DModel (36 input channels, image cross-attention)",
                "decoder": "AutoencoderKLWan"},
    latent_rule="[16, (F-1)/4+1, H/8, W/8]; the first frame's latents and mask are concatenated on the channels",
))
