"""`image_video.t2i_i2v` on tiny random folders: SD3 text-to-image, then Wan2.1 image-to-video from its images."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from engine import Engine, GenerationRequest
from engine.workflows import MissingCardsError, WorkflowRunner

PROMPTS = ["a red cat", "green hills"]
SIZE = dict(height=32, width=32, frames=5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tiny_models.core import build_tiny_sd3
    from tiny_models.wan_i2v import build_tiny_wan_i2v

    root = tmp_path_factory.mktemp("t2i-i2v")
    return {"sd3": str(build_tiny_sd3(root / "sd3")), "wan2.1-i2v": str(build_tiny_wan_i2v(root / "wan-i2v"))}


@pytest.fixture(scope="module")
def engines(folders):
    return {card: Engine.from_card(card, path=folder) for card, folder in folders.items()}


def requests():
    return [GenerationRequest(prompt=p, seed=s, card="image_video.t2i_i2v", steps=3, sampler="ode",
                              guidance_scale=2.0, **SIZE) for p, s in zip(PROMPTS, (4, 9))]


def test_t2i_i2v_makes_videos_from_the_sd3_images_as_first_frames(engines, tmp_path):
    out = WorkflowRunner(engines).run("image_video.t2i_i2v", requests(), intermediates=True)
    assert list(out.stages) == ["image", "video"]
    image = out.stages["image"].images
    assert image.shape == (2, 3, 32, 32) and out.images.shape == (2, 3, 5, 32, 32)
    assert out.weight_versions == {"sd3": 0, "wan2.1-i2v": 0}
    # By hand: SD3 alone (no frames), its images saved as 8-bit PNGs, Wan2.1-I2V on those files.
    drawn = engines["sd3"].generate([replace(r, card="sd3", frames=None) for r in requests()])
    assert torch.equal(drawn.images, image)
    paths = []
    for i, img in enumerate(drawn.images):
        path = tmp_path / f"first{i}.png"
        Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(path)
        paths.append(str(path))
    video = engines["wan2.1-i2v"].generate([replace(r, card="wan2.1-i2v", image=p)
                                            for r, p in zip(requests(), paths)])
    assert torch.equal(video.images, out.images)
    # The first frame conditions the video: another image gives another video.
    other = engines["wan2.1-i2v"].generate([replace(r, card="wan2.1-i2v", image=paths[1]) for r in requests()[:1]])
    assert not torch.allclose(other.images[0], out.images[0])


def test_t2i_i2v_without_the_video_card_fails_before_generating(engines):
    with pytest.raises(MissingCardsError, match=r"wan2\.1-i2v"):
        WorkflowRunner({"sd3": engines["sd3"]}).run("image_video.t2i_i2v", requests())


def test_rl_through_t2i_i2v_trains_the_image_stage_and_scores_the_videos(engines, folders):
    """The recipe glue on the real cards: the SD3 stage samples Flow-SDE (log-probs), the video stage runs the
    ODE on a Wan2.1-I2V model loaded from workflow.paths, and the Trajectory carries the videos."""
    from flywheel.recipe.workflow import workflow_stage_engine
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    cfg = parse_config(Config, ["model.card=sd3", "workflow.name=image_video.t2i_i2v", "workflow.stage=image",
                                f"workflow.paths.wan2.1-i2v={folders['wan2.1-i2v']}"])
    stage_engine = workflow_stage_engine(cfg, engines["sd3"], torch.device("cpu"))
    video_engine = stage_engine.runner.engines["wan2.1-i2v"]
    assert video_engine is not engines["wan2.1-i2v"]
    assert not any(p.requires_grad for p in video_engine.model.transformer.parameters())
    rollout = [replace(r, card="sd3", sampler="sde", noise_level=0.7) for r in requests()]
    traj = stage_engine.generate(rollout)
    assert traj.card == "sd3" and traj.sampler == "sde" and traj.log_probs.shape == (2, 3)
    assert bool((traj.log_probs != 0).all()) and traj.images.shape == (2, 3, 5, 32, 32)
    out = stage_engine.runner.run("image_video.t2i_i2v", rollout, intermediates=True)
    assert out.stages["video"].trajectory.sampler == "ode" and torch.equal(out.images, traj.images)
    # The video stage's model is the folder's: the fixture's engine makes the same videos from the same images.
    assert out.weight_versions == {"sd3": 0, "wan2.1-i2v": 0}
    by_fixture = WorkflowRunner(engines, stage_overrides={"video": {"sampler": "ode", "sde_window": None}})
    assert torch.equal(by_fixture.run("image_video.t2i_i2v", rollout).images, out.images)
