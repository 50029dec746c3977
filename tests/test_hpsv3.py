"""HPSv3 on a tiny random Qwen2-VL with a reward head, saved to a folder and loaded like the real one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rewards
from rewards.hpsv3 import HEAD_FILE, REWARD_TOKEN

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            REWARD_TOKEN]
WORDS = ["a", "cat", "dog", "red", "blue", "photo", "of", "the", "image", "prompt", "score", "system", "user",
         "assistant", "you", "are", "helpful", "."]


@pytest.fixture(scope="module")
def hps_folder(tmp_path_factory):
    """A Qwen2-VL of two layers (hidden 32), a word-level tokenizer, Qwen2-VL's image processor, a random head."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-hpsv3")
    vocab = {t: i for i, t in enumerate(["[UNK]"] + WORDS + SPECIALS)}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<|endoftext|>",
                                        additional_special_tokens=SPECIALS[1:])
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["[UNK]"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil().save_pretrained(folder)
    head = {"rm_head.0.weight": torch.randn(16, 32), "rm_head.0.bias": torch.randn(16),
            "rm_head.3.weight": torch.randn(8, 16), "rm_head.3.bias": torch.randn(8),
            "rm_head.5.weight": torch.randn(2, 8), "rm_head.5.bias": torch.randn(2)}
    save_file(head, str(folder / HEAD_FILE))
    return folder


PIXELS = 4 * 28 * 28  # 56 x 56: 16 patches, 4 image tokens


def images(n=3, seed=1):
    return torch.rand(n, 3, 40, 48, generator=torch.Generator().manual_seed(seed))


def test_hpsv3_score_is_the_heads_mu_at_the_reward_token(hps_folder):
    scorer = rewards.get("hpsv3", path=str(hps_folder), pixels=PIXELS)
    prompts = ["a red cat", "the blue dog", "a photo of a cat"]
    got = scorer(images(), prompts, [{}] * 3)
    assert got.shape == (3,) and got.dtype == torch.float32 and torch.isfinite(got).all()
    # Independently: the full model's last hidden layer at the <|Reward|> token through an nn.Sequential head
    # of HPSv3's layout (Linear, ReLU, Dropout, Linear, ReLU, Linear), column 0.
    from safetensors.torch import load_file

    head = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    head.load_state_dict({k.removeprefix("rm_head."): v for k, v in load_file(str(hps_folder / HEAD_FILE)).items()})
    batch = scorer.inputs(images(), prompts)
    with torch.no_grad():
        hidden = scorer.model(**batch, output_hidden_states=True).hidden_states[-1]
    rows = torch.arange(3)
    where = (batch["input_ids"] == scorer.reward_id).nonzero()
    assert where[:, 0].tolist() == [0, 1, 2]  # one reward token per row
    with torch.no_grad():
        expected = head(hidden[rows, where[:, 1]])[:, 0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Resized to about `pixels` (3136) with its aspect kept: 40 x 48 -> 56 x 84 (multiples of 28), 4 x 6 patches.
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6]] * 3


def test_hpsv3_depends_on_image_and_prompt_and_not_on_its_batch(hps_folder):
    scorer = rewards.get("hpsv3", path=str(hps_folder), pixels=PIXELS, batch_size=2)
    prompts = ["a cat", "a red cat of the blue dog", "a dog"]  # different lengths: right padding in a batch
    together = scorer(images(), prompts, [{}] * 3)
    alone = torch.cat([scorer(images()[i:i + 1], prompts[i:i + 1], [{}]) for i in range(3)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scorer(images(seed=2), prompts, [{}] * 3), together)
    assert not torch.allclose(scorer(images(), ["a dog", "a cat", "a cat"], [{}] * 3), together)


def test_hpsv3_folder_errors_name_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_HPSV3_PATH", raising=False)
    with pytest.raises(FileNotFoundError, match="FLYWHEEL_HPSV3_PATH"):
        rewards.get("hpsv3")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="lacks preprocessor_config.json, rm_head.safetensors, model.safetensors"):
        rewards.get("hpsv3", path=str(tmp_path))
