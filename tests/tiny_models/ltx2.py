"""A tiny random LTX-2 folder (joint audio+video), built from configs for tests and benchmarks; no hub.

Every component is the stock diffusers/transformers class at the smallest size
its config allows: a 1-layer Gemma-3 text encoder (with a 1-layer SigLIP vision
tower, which LTX-2 never calls), 1-layer text connectors, a 1-layer
LTX2VideoTransformer3DModel of width 16 (audio stream width 8), a one-level
video VAE (8x spatial, 2x temporal), the audio VAE at base width 16 (its 4x
time and mel compression is fixed; its latent statistics are 16 = 4 channels x
4 mel bins wide) and a two-stage vocoder (400 Hz output). Saved with
`save_pretrained`, so it loads through the path a user's folder takes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models.core import LETTERS

TEXT_WIDTH = 16  # Gemma hidden size = the connectors' width = the transformer's caption_channels
TEXT_LAYERS = 1


def gemma_tokenizer():
    """A character-level Gemma tokenizer (BPE with no merges): every letter and the space is a token."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "▁": 5}
    for c in LETTERS:
        vocab[c] = len(vocab)
    tokenizer = GemmaTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = 16
    return tokenizer


def gemma_text_encoder(seed: int = 0):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=6 + len(LETTERS), hidden_size=TEXT_WIDTH, intermediate_size=32,
                num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=64, sliding_window=16, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=4)
    return Gemma3ForConditionalGeneration(config).eval()


def build_tiny_ltx2(folder: str | Path, seed: int = 0, **sizes) -> Path:
    """A tiny random LTX-2 folder: video latents [4, (F-1)/2+1, H/8, W/8] (H, W multiples of 32, as
    LTX2Pipeline asks), audio latents [4, L, 4] with L = round(F/24 s x 25 latents/s), waveforms at 400 Hz."""
    tiny_ltx2_pipeline(seed, **sizes).save_pretrained(str(folder))
    return Path(folder)


def tiny_ltx2_pipeline(seed: int = 0, num_layers: int = 1, heads: int = 2, head_dim: int = 8,
                       audio_heads: int = 2, audio_head_dim: int = 4):
    """The LTX2Pipeline of `build_tiny_ltx2`, in memory (random weights from `seed`); the transformer's depth
    and widths (video heads·head_dim, audio audio_heads·audio_head_dim) are parameters for benchmarks."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(caption_channels=TEXT_WIDTH, text_proj_in_factor=TEXT_LAYERS + 1,
                                    video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
                                    video_connector_num_layers=1, video_connector_num_learnable_registers=None,
                                    audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
                                    audio_connector_num_layers=1, audio_connector_num_learnable_registers=None).eval()
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=heads,
        attention_head_dim=head_dim, cross_attention_dim=heads * head_dim, vae_scale_factors=(1, 8, 8),
        audio_in_channels=16, audio_out_channels=16, audio_num_attention_heads=audio_heads,
        audio_attention_head_dim=audio_head_dim, audio_cross_attention_dim=audio_heads * audio_head_dim,
        num_layers=num_layers,
        caption_channels=TEXT_WIDTH, pos_embed_max_pos=20, base_height=256, base_width=256).eval()
    vae = AutoencoderKLLTX2Video(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
                                 down_block_types=("LTX2VideoDownBlock3D",), decoder_block_out_channels=(8,),
                                 layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
                                 spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
                                 decoder_inject_noise=(False, False), downsample_type=("spatial",),
                                 upsample_type=("spatial",), upsample_residual=(False,), upsample_factor=(1,),
                                 patch_size=4, patch_size_t=1).eval()
    audio_vae = AutoencoderKLLTX2Audio(base_channels=16, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1,
                                       in_channels=2, resolution=16, latent_channels=4, mel_bins=16).eval()
    vocoder = LTX2Vocoder(in_channels=2 * 16, hidden_channels=8, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=400).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=16, max_image_seq_len=256, shift_terminal=None)
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=gemma_text_encoder(seed + 1),
                        tokenizer=gemma_tokenizer(), connectors=connectors, transformer=transformer, vocoder=vocoder)
