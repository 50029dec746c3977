"""CLIP-family scorers on tiny random CLIP models saved to a temporary folder and loaded like real ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rewards
from rewards import RewardSet

WORDS = ["a", "sign", "cat", "dog", "red", "blue", "photo", "of"]


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A tiny random CLIPModel + in-memory tokenizer + image processor, saved with save_pretrained."""
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-clip")
    specials = ["<|startoftext|>", "<|endoftext|>"]
    # Byte-level BPE with merges=[]: every word splits into characters, so the vocab needs each
    # character in both plain and end-of-word ("</w>") form.
    chars = sorted({c for w in WORDS + ["says", "hello", "the"] for c in w})
    vocab = {tok: i for i, tok in enumerate(specials + chars + [c + "</w>" for c in chars])}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)
    model = CLIPModel(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    head = {"layers.0.weight": torch.randn(8, 16), "layers.0.bias": torch.randn(8),
            "layers.2.weight": torch.randn(1, 8), "layers.2.bias": torch.randn(1)}
    save_file(head, str(folder / "aesthetic_head.safetensors"))
    return folder


def _images(n: int = 4) -> torch.Tensor:
    return torch.rand(n, 3, 40, 48, generator=torch.Generator().manual_seed(1))


def _reference_embeds(folder, images, prompts):
    """The same embeddings computed independently with transformers' own preprocessing pieces."""
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    x = F.interpolate(images, size=(32, 38), mode="bicubic", antialias=True).clamp(0, 1)[..., 3:35]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    with torch.no_grad():
        img = model.get_image_features(pixel_values=(x - mean) / std)
        txt = model.get_text_features(**tok(prompts, padding=True, return_tensors="pt"))
    img = getattr(img, "pooler_output", img)
    txt = getattr(txt, "pooler_output", txt)
    return model, F.normalize(img, dim=-1), F.normalize(txt, dim=-1)


def test_clip_score_and_pickscore_match_a_direct_computation(clip_folder, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_CLIP_PATH", str(clip_folder))  # the env var users set
    prompts = ["a red cat", "a photo of a dog", "blue sign", "a cat"]
    images = _images()
    clip = rewards.get("clip_score")
    pick = rewards.get("pickscore", path=str(clip_folder))  # the kwarg form
    model, img, txt = _reference_embeds(clip_folder, images, prompts)
    cos = (img * txt).sum(-1)
    got = clip(images, prompts, [{}] * 4)
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pick(images, prompts, [{}] * 4), model.logit_scale.exp() * cos, atol=1e-4, rtol=1e-5)
    # The score depends on the prompt: the same image against another prompt scores differently.
    assert not torch.allclose(clip(images, prompts[::-1], [{}] * 4), got)


def test_aesthetic_applies_the_saved_head_to_the_image_embedding(clip_folder):
    from safetensors.torch import load_file

    images = _images()
    scorer = rewards.get("aesthetic", path=str(clip_folder))
    _, img, _ = _reference_embeds(clip_folder, images, ["a"] * 4)
    head = load_file(str(clip_folder / "aesthetic_head.safetensors"))
    expected = F.linear(F.linear(img, head["layers.0.weight"], head["layers.0.bias"]),
                        head["layers.2.weight"], head["layers.2.bias"])[:, 0]
    torch.testing.assert_close(scorer(images, ["x"] * 4, [{}] * 4), expected, atol=1e-5, rtol=1e-5)
    # Gray 8x8 toy images work too (channel broadcast + upscale).
    gray = torch.rand(2, 1, 8, 8)
    assert torch.isfinite(scorer(gray, ["x", "y"], [{}, {}])).all()


def test_clip_scorers_work_inside_a_reward_set(clip_folder):
    reward_set = RewardSet("clip_score:1.0,jpeg_compressibility:0.1",
                           scorer_kwargs={"clip_score": {"path": str(clip_folder)}})
    batch = reward_set.score(_images(), ["a cat"] * 4, None, weight_version=3)
    assert batch.valid.all() and set(batch.scores) == {"clip_score", "jpeg_compressibility"}
    assert "reward/clip_score/mean" in batch.metrics()


def test_missing_folder_or_files_is_a_clear_error(tmp_path, monkeypatch, clip_folder):
    monkeypatch.delenv("FLYWHEEL_CLIP_PATH", raising=False)
    with pytest.raises(FileNotFoundError, match="FLYWHEEL_CLIP_PATH") as err:
        rewards.get("clip_score")
    assert "config.json" in str(err.value) and "model.safetensors" in str(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rewards.get("pickscore", path=str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as err:
        rewards.get("clip_score", path=str(tmp_path))
    message = str(err.value)
    assert "model.safetensors" in message and "preprocessor_config.json" in message and "tokenizer" in message
    lacking = message.split("lacks")[1].split(";")[0]
    # Only the absent files are listed as lacking; config.json is there.
    assert "model.safetensors" in lacking and "config.json" not in [f.strip() for f in lacking.split(",")]
    # The aesthetic head is named when absent.
    import shutil
    no_head = tmp_path / "no-head"
    shutil.copytree(clip_folder, no_head)
    (no_head / "aesthetic_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="aesthetic_head.safetensors"):
        rewards.get("aesthetic", path=str(no_head))


def test_a_weights_file_cut_short_is_refused_by_the_check_before_work(tmp_path, clip_folder):
    # Before, the folder check saw model.safetensors exist and the run died in transformers' loader after the
    # run had started; the check reads each file's header and size.
    import shutil

    from rewards.registry import check_scorer

    cut = tmp_path / "cut"
    shutil.copytree(clip_folder, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(FileNotFoundError, match=r"has unreadable weights: model\.safetensors \(\d+ bytes where its "
                                                r"header says \d+: cut short; download it again\)"):
        check_scorer("clip_score", path=str(cut))
    empty = tmp_path / "empty_head.safetensors"  # a head given apart from the folder: head=...
    empty.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"head file .*empty_head\.safetensors is unreadable: "
                                                r"empty_head\.safetensors \(not a safetensors file: 0 bytes"):
        check_scorer("aesthetic", path=str(clip_folder), head=str(empty))
    check_scorer("aesthetic", path=str(clip_folder))  # the whole folder passes
