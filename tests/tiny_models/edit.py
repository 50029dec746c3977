"""Tiny random folders of the editing cards (`flux-kontext`, `qwen-image-edit-plus`), built from configs.

Written with `save_pretrained`, so they load through the path a user's
folder takes; nothing comes from a hub (the tokenizers are built in memory).
The Kontext folder is the tiny FLUX.1 folder's components under
FluxKontextPipeline (the transformer is the same class: Kontext differs in
its inputs, not its layers).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models.core import autoencoder_kl, clip_text_encoder, clip_tokenizer, t5_encoder, t5_tokenizer


def tiny_flux_kontext_pipeline(seed: int = 0, scheduler=None, num_layers: int = 1, num_single_layers: int = 1,
                               heads: int = 2, head_dim: int = 8):
    """The FluxKontextPipeline of `build_tiny_flux_kontext`, in memory: latents [4, H/2, W/2]; the
    transformer's depth and width (heads·head_dim, head_dim a multiple of 8) are for benchmarks."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel

    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (its three rotary sections are even); got {head_dim}")
    torch.manual_seed(seed)
    # Rotary sections (index, row, column) summing to the head dim: half for the index axis, as (4, 2, 2).
    rope = (head_dim // 2, head_dim // 4, head_dim // 4)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=num_layers,
                                         num_single_layers=num_single_layers, attention_head_dim=head_dim,
                                         num_attention_heads=heads, joint_attention_dim=32,
                                         pooled_projection_dim=16, guidance_embeds=True,
                                         axes_dims_rope=rope).eval()
    # FLUX's resolution shift, its anchors scaled to tiny token counts (so the shift still varies with size).
    scheduler = scheduler or FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                             max_shift=1.15, base_image_seq_len=16,
                                                             max_image_seq_len=256)
    return FluxKontextPipeline(scheduler=scheduler, vae=autoencoder_kl(scaling=0.36, shift=0.12, seed=seed),
                               text_encoder=clip_text_encoder(16, None, seed + 1), tokenizer=clip_tokenizer(),
                               text_encoder_2=t5_encoder(32, seed=seed + 2), tokenizer_2=t5_tokenizer(),
                               transformer=transformer)


def build_tiny_flux_kontext(folder: str | Path, seed: int = 0, scheduler=None) -> Path:
    """Write the tiny FLUX.1-Kontext folder (one double and one single block, width 16)."""
    tiny_flux_kontext_pipeline(seed, scheduler).save_pretrained(str(folder))
    return Path(folder)


# ---------------------------------------------------------------------------
# Qwen-Image-Edit-Plus
# ---------------------------------------------------------------------------

# The chat and vision special tokens QwenImageEditPlusPipeline's template and its Qwen2.5-VL processor write.
EDIT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                       "<|vision_end|>", "<|video_pad|>")
# Pixels the tiny VLM's image processor resizes a condition image to (between 4 and 16 merged vision tokens;
# the released processor allows up to 1280 of them): the pipeline's own 384² resize comes first either way.
VISION_MIN_PIXELS, VISION_MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28


def _edit_template_words() -> list[str]:
    """The words of QwenImageEditPlusPipeline's system prompt (each becomes one token, as in Qwen2's real
    vocabulary, so the template's length stays near the real one)."""
    import re

    from diffusers import QwenImageEditPlusPipeline

    template = QwenImageEditPlusPipeline.__init__.__code__.co_consts
    # The template is a constant of the pipeline's __init__; without it the vocabulary is only less merged.
    text = next((c for c in template if isinstance(c, str) and c.startswith("<|im_start|>system")), "")
    words = re.findall(r" ?[A-Za-z']+", text.replace("<|im_start|>", " ").replace("<|im_end|>", " "))
    return sorted(set(words) | {"system", "user", "assistant", "Picture"})


def qwen2_vl_tokenizer():
    """A byte-level BPE Qwen2 tokenizer with the VLM's image tokens: bytes, merges building the edit template's
    words, and the special tokens."""
    from transformers import Qwen2Tokenizer

    from tiny_models.qwen_image import _byte_alphabet

    to_bytes = _byte_alphabet()
    vocab = {c: i for i, c in enumerate(to_bytes)}
    merges = []
    for word in _edit_template_words():  # left-to-right merges: "Ġ t" -> "Ġt", "Ġt h" -> "Ġth", ...
        pieces = [to_bytes[b] for b in word.encode()]
        for i in range(1, len(pieces)):
            left, merged = "".join(pieces[:i]), "".join(pieces[:i + 1])
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, pieces[i]))
    for token in EDIT_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token="<|endoftext|>", eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(EDIT_SPECIAL_TOKENS[1:])})
    return tokenizer


def qwen25_vl_with_vision(tokenizer, seed: int = 0):
    """A Qwen2.5-VL model whose vision tower runs: one text layer of width 32, one vision block of width 16
    (patch 14, 2x2 merge), the image/vision token ids the tokenizer's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tiny_models.qwen_image import TEXT_WIDTH

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in EDIT_SPECIAL_TOKENS}
    torch.manual_seed(seed)
    text = dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_WIDTH,
                  fullatt_block_indexes=[0], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  window_size=112)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen2_vl_processor(tokenizer):
    """The VLM's processor: Qwen2-VL image preprocessing (PIL backend) at the tiny pixel budget, without the
    video processor (which needs torchvision; the folder is written as a Qwen2VLProcessor's either way)."""
    from transformers import Qwen2VLImageProcessorPil

    from engine.families.qwen_image_edit import image_only_processor_class

    images = Qwen2VLImageProcessorPil(size={"shortest_edge": VISION_MIN_PIXELS, "longest_edge": VISION_MAX_PIXELS})
    return image_only_processor_class()(image_processor=images, tokenizer=tokenizer)


def _name_processor_as_released(folder: Path) -> None:
    """The folder's processor entries name Qwen2VLProcessor, as a released Qwen-Image-Edit folder's do."""
    import json

    for file, key in ((folder / "model_index.json", "processor"),):
        data = json.loads(file.read_text())
        data[key] = ["transformers", "Qwen2VLProcessor"]
        file.write_text(json.dumps(data, indent=2))
    for file in (folder / "processor" / "processor_config.json", folder / "processor" / "tokenizer_config.json"):
        data = json.loads(file.read_text())
        if "processor_class" in data:
            data["processor_class"] = "Qwen2VLProcessor"
        file.write_text(json.dumps(data, indent=2))


def tiny_qwen_image_edit_plus_pipeline(seed: int = 0, scheduler=None):
    """The QwenImageEditPlusPipeline of `build_tiny_qwen_image_edit_plus`, in memory (random weights)."""
    from diffusers import QwenImageEditPlusPipeline, QwenImageTransformer2DModel

    from tiny_models.qwen_image import LATENT_CHANNELS, TEXT_WIDTH, qwen_image_scheduler, qwen_image_vae

    tokenizer = qwen2_vl_tokenizer()
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * LATENT_CHANNELS,
                                              out_channels=LATENT_CHANNELS, num_layers=1, attention_head_dim=16,
                                              num_attention_heads=2, joint_attention_dim=TEXT_WIDTH,
                                              axes_dims_rope=(4, 6, 6)).eval()
    return QwenImageEditPlusPipeline(scheduler=scheduler or qwen_image_scheduler(), vae=qwen_image_vae(seed),
                                     text_encoder=qwen25_vl_with_vision(tokenizer, seed + 1), tokenizer=tokenizer,
                                     processor=qwen2_vl_processor(tokenizer), transformer=transformer)


def build_tiny_qwen_image_edit_plus(folder: str | Path, seed: int = 0, scheduler=None) -> Path:
    """Write the tiny Qwen-Image-Edit-Plus folder: latents [4, H/2, W/2], one transformer block of width 32."""
    tiny_qwen_image_edit_plus_pipeline(seed, scheduler).save_pretrained(str(folder))
    _name_processor_as_released(Path(folder))
    return Path(folder)
