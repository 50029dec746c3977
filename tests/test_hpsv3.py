"""HPSv3 on a tiny random Qwen2-VL with a reward head, saved to a folder and loaded like the real one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import rewards
from rewards.hpsv3 import HEAD_FILE

@pytest.fixture(scope="module")
def hps_folder(tmp_path_factory):
    """A Qwen2-VL of two layers (hidden 32), a word-level tokenizer, Qwen2-VL's image processor, a random head."""
    from tiny_models.hpsv3 import write_tiny_hpsv3

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-hpsv3")
    write_tiny_hpsv3(folder)
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
    # Every file there, but the weights are a Git LFS pointer (a clone without `git lfs pull`): refused before
    # anything loads (it was transformers' error after the run had started).
    from rewards.registry import check_scorer

    (tmp_path / "preprocessor_config.json").write_text("{}")
    (tmp_path / "rm_head.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    with pytest.raises(FileNotFoundError, match=r"has unreadable weights: model\.safetensors \(not a safetensors "
                                                r"file: a Git LFS pointer; run `git lfs pull`\); rm_head\.safetensors"):
        check_scorer("hpsv3", path=str(tmp_path))
