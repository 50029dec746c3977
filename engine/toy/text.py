"""The toy model's text side: a word-level tokenizer and a one-layer prompt encoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.toy.prompts import VOCABULARY, split_words

PAD, BOS, UNK = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<unk>")


class ToyTokenizer:
    """Word-level tokenizer over a fixed vocabulary; every prompt starts with <bos>.

    `numerals_apart`: every digit of a numeral is a word of its own ("42" -> "4", "2"),
    as toy-numbers needs; toy-digits reads "42" as one (unknown) word.
    """

    def __init__(self, vocabulary: list[str] | None = None, numerals_apart: bool = False):
        words = list(VOCABULARY if vocabulary is None else vocabulary)
        self.vocabulary = words
        self.numerals_apart = numerals_apart
        self.tokens = list(SPECIAL_TOKENS) + words
        self.token_to_id = {tok: i for i, tok in enumerate(self.tokens)}

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return len(self.tokens)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of one prompt, <bos> first, no padding or truncation."""
        return [BOS] + [self.token_to_id.get(w, UNK) for w in split_words(prompt, self.numerals_apart)]

    def __call__(self, prompts: list[str], max_length: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids LongTensor [B, L], attention_mask BoolTensor [B, L]), padded/truncated to L."""
        if isinstance(prompts, str):
            raise TypeError("ToyTokenizer takes a list of prompts, not a single string")
        ids = torch.full((len(prompts), max_length), PAD, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens = self.encode(prompt)[:max_length]
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return ids, ids != PAD


@dataclass
class ToyTextConfig:
    """Shape of the prompt encoder."""

    vocab_size: int = len(SPECIAL_TOKENS) + len(VOCABULARY)
    dim: int = 64
    max_length: int = 16
    heads: int = 4
    mlp_ratio: int = 4
    position_std: float = 0.02
    """init scale of the token position embeddings; larger tells word order apart from the first step
    (toy-numbers: "a 4 followed by a 2" is not 24)"""


class ToyPromptEncoder(nn.Module):
    """Token + position embeddings and one pre-norm transformer layer; returns (embeds, pooled)."""

    def __init__(self, config: ToyTextConfig):
        super().__init__()
        self.config = config
        d = config.dim
        self.token_embedding = nn.Embedding(config.vocab_size, d)
        self.position_embedding = nn.Parameter(torch.randn(config.max_length, d) * config.position_std)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, config.mlp_ratio * d), nn.GELU(), nn.Linear(config.mlp_ratio * d, d))
        self.norm_out = nn.LayerNorm(d)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, L], attention_mask [B, L] bool -> embeds [B, L, D] (pads zeroed), pooled [B, D]."""
        b, length = input_ids.shape
        h = self.config.heads
        x = self.token_embedding(input_ids) + self.position_embedding[:length]
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, h, -1).permute(2, 0, 3, 1, 4)
        # Key-padding mask only: <bos> is always a real key, so no row is fully masked.
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None, None, :])
        x = x + self.proj(attn.transpose(1, 2).reshape(b, length, -1))
        x = x + self.mlp(self.norm2(x))
        keep = attention_mask.unsqueeze(-1).to(x.dtype)
        embeds = self.norm_out(x) * keep
        pooled = embeds.sum(1) / keep.sum(1).clamp_min(1.0)
        return embeds, pooled
