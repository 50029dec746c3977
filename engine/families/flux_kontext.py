"""The `flux-kontext` card: FLUX.1-Kontext image editing (`FluxKontextPipeline`), conditioned on a source image.

Conventions read from diffusers 0.42.1's `FluxKontextPipeline` and followed here:

- The transformer is FLUX.1's (guidance embedded, no unconditional branch:
  `embedded_guidance = True`), the prompts FLUX.1's (T5 sequence + CLIP
  pooled), the flow times FLUX.1's (linspace(1, 1/T) shifted by the output's
  packed token count, the source tokens not counted: `image_seq_len =
  latents.shape[1]`).
- The source image is VAE-encoded (the posterior's mode, `sample_mode="argmax"`),
  normalised `(z - shift_factor)·scaling_factor`, packed into 2x2 patches like
  the noisy latents and concatenated after them on the sequence dimension.
  Its position ids are the noisy tokens' (row, column) with the first id
  coordinate set to 1 (the noisy tokens have 0): that is how the transformer
  tells them apart. The transformer's output is cut to the noisy tokens
  (`noise_pred[:, :N]`): only the generated tokens are denoised, and only
  their velocity enters the SDE steps, the log-probs and the training losses;
  the source tokens are conditioning, the same at every step.
- The pipeline's optional "true CFG" (a negative prompt and `true_cfg_scale >
  1`, two forwards) is not used: the engine's guidance scale is the embedded
  one, as for FLUX.1 (Flow-GRPO's and Flow-Factory's Kontext rollouts use the
  embedded guidance only).

Deviation, so that a batch's rows share one sequence length: the source is
resized to the request's height x width (`image_processor.resize`, then
`preprocess`, the pipeline's own two calls), where the pipeline picks the
preferred Kontext resolution closest to the image's aspect ratio
(`_auto_resize`, all about 1024² in area) whatever the output size. At a
request whose size is that preferred resolution (the pipeline's default
output for that image) the two agree; the parity tests call the pipeline with
`_auto_resize=False`, `max_area = H·W` and the source already at the request's
size.
"""

from __future__ import annotations

import torch

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.families import MMDIT_LORA_TARGETS
from engine.families.common import check_diffusers_folder, flow_time_to_batch, load_family, read_json
from engine.families.flux import COMPONENTS, FluxModel, pack_latents, unpack_latents
from engine.families.source_image import distinct_rows, load_source_image

CARD_ID = "flux-kontext"
PIPELINE = "FluxKontextPipeline"


class FluxKontextModel(FluxModel):
    """FlowModel of FLUX.1-Kontext: FLUX.1 with the source image's tokens after the noisy ones."""

    card_id = CARD_ID
    image_conditioned = True

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = 512):
        super().__init__(pipe, dtype, scheduler_config, max_sequence_length)
        self._joint_ids: dict[tuple, torch.Tensor] = {}

    def encode_images(self, paths: list[str], latent_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Per-row source conditioning {"image_latents": [B, C, h, w]} (fp32, normalised, unpacked), the source
        resized to the output's size; each distinct path is encoded once."""
        distinct, rows = distinct_rows(paths)
        height, width = latent_shape[-2] * self.vae_scale, latent_shape[-1] * self.vae_scale
        latents = torch.cat([self._source_latents(load_source_image(p, CARD_ID), height, width) for p in distinct])
        return {"image_latents": latents.index_select(0, torch.tensor(rows, device=latents.device))}

    def _source_latents(self, image, height: int, width: int) -> torch.Tensor:
        """VAE latents [1, C, h, w] (fp32) of one image, through the pipeline's resize and preprocess."""
        processor = self.pipe.image_processor
        pixels = processor.preprocess(processor.resize(image, height, width), height, width)
        posterior = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        config = self.vae.config
        return ((posterior.mode() - config.shift_factor) * config.scaling_factor).float()

    def joint_ids(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """Position ids [2N, 3] of the noisy tokens then the source's (first coordinate 1), built once per size."""
        key = (h, w, str(device))
        if key not in self._joint_ids:
            noisy = self.image_ids(h, w, device)
            source = noisy.clone()
            source[:, 0] = 1
            self._joint_ids[key] = torch.cat([noisy, source])
        return self._joint_ids[key]

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds,
                 guidance: float | None = None) -> torch.Tensor:
        """Velocity (fp32) of the noisy latents, the source tokens read beside them and cut from the output."""
        if cond.extra is None or "image_latents" not in cond.extra:
            got = None if cond.extra is None else sorted(cond.extra)
            raise ValueError(f"{CARD_ID}: the conditioning has no source image (PromptEmbeds.extra needs "
                             f"'image_latents' from encode_images); got extra={got}")
        b, c, h, w = latents.shape
        timestep = flow_time_to_batch(t, b, latents.device) * 1000.0 / 1000.0
        g = None
        if self.guidance_embeds:
            g = torch.full((b,), 1.0 if guidance is None else float(guidance), dtype=torch.float32,
                           device=latents.device)
        noisy = pack_latents(latents)
        hidden = torch.cat([noisy, pack_latents(cond.extra["image_latents"].to(latents.dtype))], dim=1)
        text_ids = torch.zeros(cond.embeds.shape[1], 3, device=latents.device, dtype=self.dtype)
        out = transformer(hidden_states=hidden.to(self.dtype), timestep=timestep, guidance=g,
                          pooled_projections=cond.pooled.to(self.dtype),
                          encoder_hidden_states=cond.embeds.to(self.dtype), txt_ids=text_ids,
                          img_ids=self.joint_ids(h, w, latents.device), return_dict=False)[0]
        return unpack_latents(out[:, :noisy.shape[1]].float(), c, h, w)


def load_flux_kontext(path, device: torch.device, dtype: torch.dtype) -> FluxKontextModel:
    """Load FLUX.1-Kontext from a local diffusers folder (every component in `dtype`)."""
    root = check_diffusers_folder(path, CARD_ID, COMPONENTS)
    index = read_json(root / "model_index.json")
    # A FLUX.1-dev folder has the same components and would load, but its weights never learned to edit.
    if index.get("_class_name") not in (None, PIPELINE):
        raise ValueError(f"{CARD_ID}: {root} holds a {index['_class_name']} folder; this card loads a {PIPELINE} "
                         f"folder (FLUX.1-Kontext-dev)")
    return load_family(FluxKontextModel, PIPELINE, COMPONENTS, root, device, dtype)


register_card(ModelCard(
    id=CARD_ID,
    description="FLUX.1-Kontext image editing (guidance embedded; the source image's VAE tokens follow the noisy "
                "ones) from a local diffusers folder; each request gives its source image (GenerationRequest.image).",
    load=load_flux_kontext,
    # FluxKontextPipeline's default guidance (3.5); 10 rollout steps and 512px as the other FLUX-family cards.
    defaults=dict(steps=10, guidance_scale=3.5, noise_level=0.7, height=512, width=512,
                  lora_targets=MMDIT_LORA_TARGETS, diffusers_pipeline=PIPELINE, video=False,
                  image_conditioned=True),
    components={"prompt_encoder": "CLIP-L + T5-XXL", "transformer": "FluxTransformer2DModel (source tokens "
                "concatenated on the sequence, image ids with first coordinate 1)", "decoder": "AutoencoderKL"},
    latent_rule="[16, H/8, W/8]; the source image's latents at the same size are packed after the noisy tokens",
))
