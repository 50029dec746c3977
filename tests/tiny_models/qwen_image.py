"""A tiny random Qwen-Image diffusers folder, built from configs (tests and benchmarks; no hub).

Every component is the class `QwenImagePipeline` loads: a Qwen2.5-VL text
encoder (one text layer of width 32 and a one-block vision tower that text
prompts never run), a byte-level BPE Qwen2 tokenizer built in memory with the
chat-template special tokens and the template's words, a
one-block QwenImage transformer, and the smallest AutoencoderKLQwenImage the
config allows (2x spatial compression: `vae_scale_factor` is 2 ** number of
temporal-downsample flags, so one flag for one spatial down-sampling).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# The special tokens QwenImagePipeline's prompt template writes (a chat turn); the pad token is <|endoftext|>.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEXT_WIDTH = 32  # the text encoder's hidden size = the transformer's joint_attention_dim
LATENT_CHANNELS = 4


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[str, ...]:
    """The 256 printable characters byte-level BPE maps bytes to (GPT-2's reversible byte table)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:  # bytes with no printable character are moved past 255, in byte order
            chars.append(chr(256 + extra))
            extra += 1
    return tuple(chars)


# The words of QwenImagePipeline's system prompt and chat roles. With one token per word (as Qwen2's real
# vocabulary has) the template's prefix up to the user's text is 34 tokens, the count the pipeline drops
# (`prompt_template_encode_start_idx`), so the embeddings hold the prompt and the closing turn only.
TEMPLATE_WORDS = ("system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color",
                  " shape", " size", " texture", " quantity", " text", " spatial", " relationships", " of",
                  " objects", " and", " background")


def qwen2_tokenizer():
    """A Qwen2 byte-level BPE tokenizer: every byte is a token, merges build the template's words, and the
    chat special tokens; prompts outside the template are mostly one token per byte."""
    from transformers import Qwen2Tokenizer

    to_bytes = _byte_alphabet()
    vocab = {c: i for i, c in enumerate(to_bytes)}
    merges = []
    for word in TEMPLATE_WORDS:  # left-to-right merges: "Ġ t" -> "Ġt", "Ġt h" -> "Ġth", ...
        pieces = [to_bytes[b] for b in word.encode()]
        for i in range(1, len(pieces)):
            left, merged = "".join(pieces[:i]), "".join(pieces[:i + 1])
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, pieces[i]))
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token="<|endoftext|>", eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


def qwen25_vl_text_encoder(vocab_size: int, seed: int = 0):
    """A Qwen2.5-VL model with one text layer (width TEXT_WIDTH, 2 heads of 16, multimodal RoPE sections
    summing to half a head) and a one-block vision tower of width 16 (built because the class has one)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=vocab_size, hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=vocab_size - 3, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 3)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_WIDTH,
                  fullatt_block_indexes=[0], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  window_size=112)
    # Token ids the VLM reserves for images and videos: past the text vocabulary, never produced here.
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab_size,
                              video_token_id=vocab_size + 1, vision_start_token_id=vocab_size + 2,
                              vision_end_token_id=vocab_size + 3)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def qwen_image_vae(seed: int = 0):
    """AutoencoderKLQwenImage at its smallest: one down-sampling level (2x), base width 8, z_dim 4, with a
    non-trivial per-channel latent mean and std (so a decode that skips the normalisation is caught)."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1], num_res_blocks=1,
                                  temperal_downsample=[False], latents_mean=[0.1, -0.2, 0.3, -0.1],
                                  latents_std=[1.5, 0.8, 1.2, 2.0]).eval()


def qwen_image_scheduler():
    """Qwen-Image's released scheduler settings (resolution-dependent exponential shift with a terminal
    sigma), with the shift anchors scaled to tiny token counts so the shift still varies with size."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=0.9, base_image_seq_len=16,
                                           max_image_seq_len=512, shift_terminal=0.02,
                                           time_shift_type="exponential")


def tiny_qwen_image_pipeline(seed: int = 0, scheduler=None, num_layers: int = 1, heads: int = 2,
                             head_dim: int = 16):
    """The QwenImagePipeline of `build_tiny_qwen_image`, in memory (random weights from `seed`); the
    transformer's depth and width (heads·head_dim, head_dim a multiple of 16) are for benchmarks."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (its rotary sections are even); got {head_dim}")
    tokenizer = qwen2_tokenizer()
    torch.manual_seed(seed)
    # The rotary sections (frame, height, width) sum to the head dim: a quarter for the frame axis.
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * LATENT_CHANNELS,
                                              out_channels=LATENT_CHANNELS, num_layers=num_layers,
                                              attention_head_dim=head_dim, num_attention_heads=heads,
                                              joint_attention_dim=TEXT_WIDTH, axes_dims_rope=rope).eval()
    return QwenImagePipeline(scheduler=scheduler or qwen_image_scheduler(), vae=qwen_image_vae(seed),
                             text_encoder=qwen25_vl_text_encoder(len(tokenizer), seed + 1), tokenizer=tokenizer,
                             transformer=transformer)


def build_tiny_qwen_image(folder: str | Path, seed: int = 0, scheduler=None) -> Path:
    """A tiny random Qwen-Image folder: latents [4, H/2, W/2], transformer width 32, one block."""
    tiny_qwen_image_pipeline(seed, scheduler).save_pretrained(str(folder))
    return Path(folder)
