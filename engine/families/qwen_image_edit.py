"""The `qwen-image-edit-plus` card: Qwen-Image-Edit-Plus (2509/2511, `QwenImageEditPlusPipeline`) image editing.

Conventions read from diffusers 0.42.1's `QwenImageEditPlusPipeline` and followed here:

- Prompts are read with the source image. The Qwen2.5-VL encoder takes the
  edit template around "Picture 1: <|vision_start|><|image_pad|><|vision_end|>"
  and the instruction, the image resized to CONDITION_IMAGE_SIZE (384² in
  area, the image's aspect ratio, sides rounded to 32) going through the VLM's
  processor and vision tower; the last hidden state, the template's first 64
  tokens dropped (`prompt_template_encode_start_idx`), is the text context.
  The negative prompt's branch reads the same image. The pipeline runs one
  prompt at a time (it refuses batches); the card encodes each distinct
  (prompt, image) pair of a batch that way and zero-pads every embedding to
  one fixed length, `max_sequence_length` (512: the ~196 vision tokens of a
  384² image, the template's tail and the instruction), with its mask, as the
  `qwen-image` card pads. An encoding longer than that is an error naming
  both lengths (the pipeline does not truncate either). These embeddings
  depend on the image, so they bypass the engine's per-prompt cache
  (`prompts_read_images`) and the trajectory carries them.
- The source image is VAE-encoded through the video VAE's single frame (the
  posterior's mode), normalised `(z - mean) / std`, packed into 2x2 patches
  and concatenated after the noisy tokens; `img_shapes` lists both grids,
  [(1, h/2, w/2), (1, h/2, w/2)], which is how the transformer's RoPE places
  them. The output is cut to the noisy tokens (`noise_pred[:, :N]`): only the
  generated tokens are denoised and trained, the source's are conditioning.
- CFG, flow times and decoding are Qwen-Image's (`qwen-image` card): true CFG
  with the norm rescale, on the cut velocities; the shift from the output's
  token count only.

Deviations. The source's VAE latents are taken at the request's height x width
(`image_processor.preprocess(image, H, W)`, the pipeline's own call), where
the pipeline takes them at VAE_IMAGE_SIZE (1024² in area at the image's
aspect ratio) whatever the output size, so that a batch's rows share one
sequence length; at the pipeline's default output size for the image (the
same 1024² area and aspect ratio) the two agree. One source image per request
(the Plus pipeline also takes several; not supported). The parity tests set
the pipeline module's VAE_IMAGE_SIZE to H·W.

Without torchvision, transformers cannot build Qwen2VLProcessor (its video
processor needs it). The card then loads the folder's image processor (PIL
backend) and tokenizer into an image-only processor, which tokenizes and
preprocesses images exactly as the full one (videos are never used here).
"""

from __future__ import annotations

import importlib.util
import json
from functools import lru_cache

import torch

from engine.cards import ModelCard, PromptEmbeds, register_card
from engine.families import MMDIT_LORA_TARGETS
from engine.families.common import check_diffusers_folder, flow_time_to_batch, prepare_pipeline, read_json
from engine.families.flux import pack_latents, unpack_latents
from engine.families.qwen_image import QwenImageModel
from engine.families.source_image import distinct_rows, load_source_image

CARD_ID = "qwen-image-edit-plus"
PIPELINE = "QwenImageEditPlusPipeline"
COMPONENTS = {"transformer": "model", "vae": "model", "scheduler": "scheduler", "text_encoder": "model",
              "tokenizer": "tokenizer", "processor": "tokenizer"}
TEXT_TOKENS = 512  # vision tokens of the 384² condition image (~196) + the template's tail + the instruction


class QwenImageEditPlusModel(QwenImageModel):
    """FlowModel of Qwen-Image-Edit-Plus: Qwen-Image with the source image in the prompt and beside the latents."""

    card_id = CARD_ID
    image_conditioned = True
    prompts_read_images = True  # encode_prompts(prompts, images=...): the engine's text-only cache is bypassed

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, max_sequence_length: int = TEXT_TOKENS):
        super().__init__(pipe, dtype, scheduler_config, max_sequence_length)
        # The source's normalisation divides by std itself (the pipeline's arithmetic), not by 1 / (1 / std).
        self._mean_2d = self._mean[:, :, 0]
        self._std_2d = torch.tensor(self.vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1)

    def encode_prompts(self, prompts: list[str], images: list[str] | None = None) -> PromptEmbeds:
        """The VLM embeddings of each (prompt, source image) pair (fp32), zero-padded to `max_sequence_length`
        tokens, with their mask; each distinct pair is encoded once."""
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{CARD_ID}: prompts are encoded with their source image; got {len(prompts)} "
                             f"prompt(s) and {'no' if images is None else len(images)} image(s)")
        pairs, rows = distinct_rows(list(zip(prompts, images)))
        length = self.max_sequence_length
        condition = {path: self._condition_image(path) for path in dict.fromkeys(images)}
        embeds = []
        for prompt, path in pairs:
            e, _ = self.pipe._get_qwen_prompt_embeds([prompt], [condition[path]], self.device)
            if e.shape[1] > length:
                raise ValueError(f"{CARD_ID}: prompt {prompt!r} with its image {path!r} encodes to {e.shape[1]} "
                                 f"tokens, more than max_sequence_length={length}; shorten the instruction")
            embeds.append(e[0].float())
        d = embeds[0].shape[-1]
        padded = torch.zeros(len(pairs), length, d, device=embeds[0].device)
        mask = torch.zeros(len(pairs), length, dtype=torch.bool, device=embeds[0].device)
        for i, e in enumerate(embeds):
            padded[i, :e.shape[0]] = e
            mask[i, :e.shape[0]] = True
        index = torch.tensor(rows, device=padded.device)
        padded, mask = padded.index_select(0, index), mask.index_select(0, index)
        return PromptEmbeds(padded, padded.new_zeros(len(prompts), 0), mask)

    def _condition_image(self, path: str):
        """The source resized for the VLM as the pipeline resizes it (CONDITION_IMAGE_SIZE in area)."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as stock

        image = load_source_image(path, CARD_ID)
        width, height = stock.calculate_dimensions(stock.CONDITION_IMAGE_SIZE, image.width / image.height)
        return self.pipe.image_processor.resize(image, height, width)

    def encode_images(self, paths: list[str], latent_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Per-row source latents {"image_latents": [B, C, h, w]} (fp32, normalised) at the output's size."""
        distinct, rows = distinct_rows(paths)
        height, width = latent_shape[-2] * self.vae_scale, latent_shape[-1] * self.vae_scale
        latents = torch.cat([self._source_latents(load_source_image(p, CARD_ID), height, width) for p in distinct])
        return {"image_latents": latents.index_select(0, torch.tensor(rows, device=latents.device))}

    def _source_latents(self, image, height: int, width: int) -> torch.Tensor:
        pixels = self.pipe.image_processor.preprocess(image, height, width).unsqueeze(2)
        z = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist.mode()[:, :, 0]
        mean, std = self._mean_2d.to(z.device, z.dtype), self._std_2d.to(z.device, z.dtype)
        return ((z - mean) / std).float()  # the pipeline's order: (z - mean) / std

    def velocity(self, transformer, latents: torch.Tensor, t, cond: PromptEmbeds) -> torch.Tensor:
        """Velocity (fp32) of the noisy latents; the source tokens follow them and are cut from the output."""
        if cond.extra is None or "image_latents" not in cond.extra:
            got = None if cond.extra is None else sorted(cond.extra)
            raise ValueError(f"{CARD_ID}: the conditioning has no source image (PromptEmbeds.extra needs "
                             f"'image_latents' from encode_images); got extra={got}")
        b, c, h, w = latents.shape
        timestep = flow_time_to_batch(t, b, latents.device) * 1000.0 / 1000.0
        noisy = pack_latents(latents)
        hidden = torch.cat([noisy, pack_latents(cond.extra["image_latents"].to(latents.dtype))], dim=1)
        out = transformer(hidden_states=hidden.to(self.dtype), timestep=timestep,
                          encoder_hidden_states=cond.embeds.to(self.dtype), encoder_hidden_states_mask=cond.mask,
                          img_shapes=[[(1, h // 2, w // 2), (1, h // 2, w // 2)]] * b, return_dict=False)[0]
        return unpack_latents(out[:, :noisy.shape[1]].float(), c, h, w)


@lru_cache(maxsize=1)
def image_only_processor_class():
    """Qwen2VLProcessor without its video processor (which transformers builds only with torchvision)."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor


def load_vl_processor(folder):
    """The folder's Qwen2-VL processor; the image-only one (same image preprocessing and tokenizer) when
    torchvision, which its video processor needs, is not installed."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    if importlib.util.find_spec("torchvision") is not None:
        return Qwen2VLProcessor.from_pretrained(str(folder), local_files_only=True)
    config_file = folder / "processor_config.json"
    settings = (json.loads(config_file.read_text()).get("image_processor") if config_file.is_file() else None)
    if settings is None:  # older folders keep the image processor's settings in their own file
        settings = read_json(folder / "preprocessor_config.json")
    settings = {k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")}
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return image_only_processor_class()(image_processor=Qwen2VLImageProcessorPil(**settings), tokenizer=tokenizer)


def load_qwen_image_edit_plus(path, device: torch.device, dtype: torch.dtype) -> QwenImageEditPlusModel:
    """Load Qwen-Image-Edit-Plus from a local diffusers folder (every component in `dtype`)."""
    root = check_diffusers_folder(path, CARD_ID, COMPONENTS)
    index = read_json(root / "model_index.json")
    if index.get("_class_name") not in (None, PIPELINE):
        raise ValueError(f"{CARD_ID}: {root} holds a {index['_class_name']} folder; this card loads a {PIPELINE} "
                         f"folder (Qwen-Image-Edit-2509 or -2511)")
    import diffusers

    pipe = diffusers.QwenImageEditPlusPipeline.from_pretrained(
        str(root), dtype=dtype, local_files_only=True, processor=load_vl_processor(root / "processor"))
    pipe = prepare_pipeline(pipe, torch.device(device))
    return QwenImageEditPlusModel(pipe, dtype, read_json(root / "scheduler" / "scheduler_config.json"))


register_card(ModelCard(
    id=CARD_ID,
    description="Qwen-Image-Edit-Plus image editing (Qwen2.5-VL reads the instruction with the source image; the "
                "source's VAE tokens follow the noisy ones; true CFG) from a local diffusers folder; each request "
                "gives its source image (GenerationRequest.image).",
    load=load_qwen_image_edit_plus,
    # QwenImageEditPlusPipeline's documented true_cfg_scale 4.0; 10 rollout steps and noise 1.2 as qwen-image's.
    defaults=dict(steps=10, guidance_scale=4.0, noise_level=1.2, height=512, width=512,
                  lora_targets=MMDIT_LORA_TARGETS, diffusers_pipeline=PIPELINE, video=False,
                  image_conditioned=True),
    components={"prompt_encoder": "Qwen2.5-VL-7B (instruction + source image)",
                "transformer": "QwenImageTransformer2DModel (source tokens concatenated on the sequence)",
                "decoder": "AutoencoderKLQwenImage"},
    latent_rule="[16, H/8, W/8]; the source image's latents at the same size are packed after the noisy tokens",
))
