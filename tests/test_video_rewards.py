"""Video versions of PickScore, CLIP score and aesthetic: the mean of the image scorer over K frames."""

from __future__ import annotations

import math

import pytest
import torch

import rewards
from flywheel.video import MiddleFrameRewards, middle_frame
from rewards import RewardSet
from rewards.video import FrameMean, frame_indices, sample_frames

pytest.importorskip("transformers")
from test_clip_rewards import clip_folder  # noqa: E402,F401  (the tiny random CLIP folder fixture)


def test_video_reward_frames_are_span_centres_and_one_is_the_middle_frame():
    assert frame_indices(8, 4) == [1, 3, 5, 7]
    assert frame_indices(9, 3) == [1, 4, 7]
    assert frame_indices(5, 8) == [0, 1, 2, 3, 4]  # K >= F: every frame
    videos = torch.rand(2, 3, 9, 4, 4)
    assert torch.equal(sample_frames(videos, 1)[:, 0], middle_frame(videos))
    assert torch.equal(sample_frames(videos, 3), videos[:, :, [1, 4, 7]].transpose(1, 2))
    with pytest.raises(ValueError, match="frames must be an integer >= 1"):
        FrameMean(lambda *a: None, "x", frames=0)


def test_video_reward_is_the_mean_over_frames_and_a_bad_frame_masks_its_video():
    def brightness(images, prompts, metadata):  # an image scorer that can also fail on a frame
        out = images.mean(dim=(1, 2, 3))
        return torch.where(out > 0.95, torch.full_like(out, math.nan), out)

    videos = (torch.arange(6.0).view(1, 1, 6, 1, 1).expand(2, 3, 6, 2, 2) / 10).clone()  # frame f: brightness f/10
    videos[1, :, 3] = 1.0  # video 1's frame 3 cannot be scored
    scorer = FrameMean(brightness, "brightness_video", frames=3)  # frames 1, 3, 5
    got = scorer(middle_frame(videos), ["a", "b"], [{}, {}], videos=videos)
    assert got[0] == pytest.approx((0.1 + 0.3 + 0.5) / 3)
    assert math.isnan(got[1])  # a mean over the frames that scored would be another reward
    videos[1, :, 3] = 0.3
    videos[1, :, 4] = 1.0  # a frame the three do not include
    assert scorer(middle_frame(videos), ["a", "b"], [{}, {}], videos=videos)[1] == pytest.approx(0.3)
    scorer = FrameMean(brightness, "brightness_video", frames=6)
    got = scorer(middle_frame(videos), ["a", "b"], [{}, {}], videos=videos)
    assert got[0] == pytest.approx(sum(range(6)) / 60) and math.isnan(got[1])


def test_video_reward_clip_pickscore_aesthetic_average_their_image_scores(clip_folder):
    torch.manual_seed(0)
    videos = torch.rand(2, 3, 8, 40, 48)
    prompts, meta = ["a red cat", "a blue dog"], [{}, {}]
    frames = videos[:, :, [1, 3, 5, 7]]  # K = 4 of 8
    for name in ("clip_score", "pickscore", "aesthetic"):
        image_scorer = rewards.get(name, path=str(clip_folder))
        video_scorer = rewards.get(f"{name}_video", path=str(clip_folder), frames=4)
        assert video_scorer.wants_video and video_scorer.name == f"{name}_video"
        per_frame = torch.stack([image_scorer(frames[:, :, k], prompts, meta) for k in range(4)], dim=1)
        got = video_scorer(middle_frame(videos), prompts, meta, videos=videos)
        torch.testing.assert_close(got, per_frame.mean(1), atol=1e-5, rtol=1e-5)
        # Not the middle frame alone: the clip's other frames move the score.
        assert not torch.allclose(got, image_scorer(middle_frame(videos), prompts, meta), atol=1e-6)


def test_video_reward_reaches_whole_clips_through_a_video_cards_reward_set(clip_folder):
    videos = torch.rand(2, 3, 5, 40, 48, generator=torch.Generator().manual_seed(3))
    spec = "clip_score:1.0,clip_score_video:1.0"
    kwargs = {"clip_score": {"path": str(clip_folder)}, "clip_score_video": {"path": str(clip_folder), "frames": 5}}
    reward_set = RewardSet(spec, scorer_kwargs=kwargs)
    assert reward_set.wants_video
    batch = MiddleFrameRewards(reward_set).score(videos, ["a cat", "a dog"], None, 0)  # as the recipe scores videos
    image = rewards.get("clip_score", path=str(clip_folder))
    torch.testing.assert_close(batch.scores["clip_score"], image(middle_frame(videos), ["a cat", "a dog"], [{}, {}]))
    every = torch.stack([image(videos[:, :, f], ["a cat", "a dog"], [{}, {}]) for f in range(5)], 1).mean(1)
    torch.testing.assert_close(batch.scores["clip_score_video"], every, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="clip_score_video.*needs videos"):
        reward_set.score(torch.rand(2, 3, 40, 48), ["a", "b"], None, 0)
