"""A tiny random HPSv3 folder: a Qwen2-VL of two layers (width 32), a word-level tokenizer, Qwen2-VL's image
processor and a random reward head, laid out as the real one (rewards/hpsv3.py loads it)."""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.hpsv3 import HEAD_FILE, REWARD_TOKEN

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            REWARD_TOKEN]
WORDS = ["a", "cat", "dog", "red", "blue", "photo", "of", "the", "image", "prompt", "score", "system", "user",
         "assistant", "you", "are", "helpful", "."]


def write_tiny_hpsv3(folder: Path, max_positions: int = 4096) -> int:
    """Write the folder (drawing from torch's global generator: seed it first); returns the backbone's
    parameter count. `max_positions` must hold the image tokens of the largest image scored."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vocab = {t: i for i, t in enumerate(["[UNK]"] + WORDS + SPECIALS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIALS[1:])
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["[UNK]"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    head = {"rm_head.0.weight": torch.randn(16, 32), "rm_head.0.bias": torch.randn(16),
            "rm_head.3.weight": torch.randn(8, 16), "rm_head.3.bias": torch.randn(8),
            "rm_head.5.weight": torch.randn(2, 8), "rm_head.5.bias": torch.randn(2)}
    save_file(head, str(Path(folder) / HEAD_FILE))
    return sum(p.numel() for p in model.parameters())
