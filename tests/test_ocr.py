"""The `ocr` reward: RapidOCR reads PIL-rendered text; the Flow-GRPO edit-distance score."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards
from rewards.ocr import OcrReward, _model_files, ocr_score, target_text


def render(text: str, size=(256, 64)) -> torch.Tensor:
    """Black text on white, [3, H, W] in [0, 1], with PIL's built-in scalable font (no file needed)."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((10, 10), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    return rewards.get("ocr")


def test_target_text_and_score_formula():
    assert target_text('a sign that says "HELLO"') == "HELLO"
    assert target_text("a neon sign reading 'Open 24h' at night") == "Open 24h"
    assert target_text("no quotes here") is None
    assert target_text("ignored", {"text": "META"}) == "META"
    assert ocr_score("HELLO", "HELLO") == 1.0
    assert ocr_score("hel lo", "HELLO") == 1.0  # case and whitespace are ignored
    assert ocr_score("the sign: HELLO!", "hello") == 1.0  # target found inside the read text
    assert ocr_score("HELP", "HELLO") == pytest.approx(1 - 2 / 5)  # two edits
    assert ocr_score("", "HELLO") == 0.0
    assert ocr_score("a completely different long text", "HI") == 0.0  # distance capped at len


def test_models_are_the_local_files_shipped_in_the_wheel(ocr):
    files = _model_files()
    for kind in ("det", "cls", "rec"):
        assert files[kind].is_file() and files[kind].suffix == ".onnx"
    # RapidOCR is told these exact paths, so it never resolves (or downloads) a model by name.
    assert str(ocr.engine.cfg.Rec.model_path) == str(files["rec"])
    assert str(ocr.engine.cfg.Det.model_path) == str(files["det"])


def test_ocr_reads_rendered_text_and_scores_it(ocr):
    images = torch.stack([render("HELLO"), render("HELP"), render("FLOW"), render("WORLD")])
    prompts = ['a sign that says "HELLO"', 'a sign that says "HELLO"', "a plain photo", 'a sign that says "WORLD"']
    assert ocr.read(images[[0, 1]]) == ["HELLO", "HELP"]
    scores = ocr(images, prompts, [{}] * 4)
    assert scores[0].item() == 1.0 and scores[3].item() == 1.0
    assert scores[1].item() == pytest.approx(0.6)  # HELP vs HELLO: 2 edits over 5 letters
    assert torch.isnan(scores[2])  # no quoted text: masked, not zero
    # The recogniser's character list is embedded in the shipped ONNX file (else RapidOCR would fetch a dict).
    assert ocr.engine.text_rec.session.have_key()


def test_ocr_without_detection_and_blank_images():
    fast = OcrReward(detect=False)  # whole images as text lines, one batched recognition call
    images = torch.stack([render("HELLO"), render("CAT")])
    assert fast.read(images) == ["HELLO", "CAT"]
    blank = torch.ones(2, 3, 64, 256)
    scores = rewards.get("ocr")(blank, ['"HELLO"', '"CAT"'], [{}, {}])
    assert scores.tolist() == [0.0, 0.0]  # nothing read: the worst score, still valid


def test_prompt_coverage_says_which_prompts_each_masking_scorer_can_score():
    from rewards.registry import prompt_coverage

    prompts = ['a sign that says "HELLO"', "a handwritten 7", "the number 42", "a cat"]
    metadata = [{}, {}, {}, {"text": "CAT"}]
    assert prompt_coverage("ocr", prompts, metadata)[0] == [True, False, False, True]
    assert prompt_coverage("digit_alignment", prompts, metadata)[0] == [False, True, False, False]
    assert prompt_coverage("number_alignment", prompts, metadata)[0] == [False, False, True, False]
    assert "quoted" in prompt_coverage("ocr", prompts, metadata)[1]
    assert prompt_coverage("jpeg_compressibility", prompts, metadata) is None  # scores every image
    assert prompt_coverage("remote:http://127.0.0.1:1", prompts, metadata) is None
