"""The `wan2.1-i2v` card (Wan2.1 image-to-video) on a tiny random WanImageToVideoPipeline folder.

The folder is written with `save_pretrained` once per session and loaded through
the card's loader. Parity runs the engine's ODE rollout and the stock pipeline's
own __call__ on the same weights, prompt embeddings, initial noise and first
frames. The pipeline takes one image per call (it repeats a single image over its
batch), so it runs one call per row; the engine runs the three rows as one batch.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine import Engine, GenerationRequest, get_card, list_cards, load_model
from flywheel.lora import adapters_disabled, add_lora, save_lora_for_diffusers
from flywheel.prompts import MISSING_IMAGES_SHOWN, load_prompts

CARD = "wan2.1-i2v"
SIZE = dict(height=16, width=32, frames=5)  # non-square: latents [16, 2, 2, 4]
PROMPTS = ["a red cat", "a blue dog", "green hills"]
SEEDS = (3, 11, 5)
# Three first frames of different sizes and aspect ratios (the pipeline resizes each to 16x32).
IMAGE_SIZES = [(20, 36), (40, 24), (16, 16)]


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    from tiny_models.wan_i2v import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny-wan-i2v") / "wan-i2v")


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Three random RGB PNGs: distinct content, so the conditioning shows in the output."""
    root = tmp_path_factory.mktemp("first-frames")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(IMAGE_SIZES):
        path = root / f"frame{i}.png"
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="session")
def model(folder):
    return load_model(CARD, path=str(folder))


@pytest.fixture(scope="session")
def stock(folder):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def requests(images, guidance, steps=4, sampler="ode", **kwargs):
    return [GenerationRequest(prompt=p, seed=s, card=CARD, steps=steps, sampler=sampler, guidance_scale=guidance,
                              image=image, **SIZE, **kwargs) for p, s, image in zip(PROMPTS, SEEDS, images)]


def stock_latents(pipe, engine, images, steps, guidance):
    """Final latents of WanImageToVideoPipeline.__call__, one call per row, fed the engine's prompt embeddings,
    the engine's initial noise (one generator per request seed) and the same image file."""
    shape = engine.model.latent_shape(SIZE["height"], SIZE["width"], SIZE["frames"])
    cond, uncond = engine.encode_prompts(PROMPTS), engine.encode_prompts([""] * len(PROMPTS))
    rows = []
    for i, (seed, path) in enumerate(zip(SEEDS, images)):
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).unsqueeze(0)
        with torch.no_grad():
            out = pipe(image=Image.open(path).convert("RGB"), prompt_embeds=cond.embeds[i:i + 1],
                       negative_prompt_embeds=uncond.embeds[i:i + 1], latents=noise, num_inference_steps=steps,
                       guidance_scale=guidance, height=SIZE["height"], width=SIZE["width"],
                       num_frames=SIZE["frames"], output_type="latent").frames
        rows.append(out.float())
    return torch.cat(rows)


# ---- the card --------------------------------------------------------------------------------


def test_card_is_registered_with_its_pipeline_and_lora_targets():
    """Registration imports no diffusers: tests/test_families.py checks it for every family module at once
    (list_cards imports them all, this one included)."""
    assert CARD in list_cards()
    defaults = get_card(CARD).defaults
    assert defaults["diffusers_pipeline"] == "WanImageToVideoPipeline" and defaults["video"] is True
    assert defaults["image_conditioned"] is True
    assert "attn2.add_k_proj" in defaults["lora_targets"]  # the image cross-attention is trained too
    assert get_card(CARD).load.__module__ == "engine.families.wan_i2v"


def test_folder_errors_name_what_is_missing_or_unsupported(folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / "image_encoder")
    shutil.rmtree(broken / "image_processor")
    with pytest.raises(FileNotFoundError, match="incomplete; missing: ") as err:
        load_model(CARD, path=str(broken))
    # Both missing components in one message, and only them (the present ones are not listed).
    listed = str(err.value).split("missing: ", 1)[1].split("; ")
    assert sorted(listed) == ["image_encoder/ (model)", "image_processor/ (processor)"]
    (broken / "image_processor").mkdir()  # the folder without its file is named by the file
    with pytest.raises(FileNotFoundError,
                       match=r"missing: image_encoder/ \(model\); image_processor/preprocessor_config\.json$"):
        load_model(CARD, path=str(broken))

    def variant(name, file, **changes):
        copy = tmp_path / name
        shutil.copytree(folder, copy)
        config = json.loads((copy / file).read_text())
        (copy / file).write_text(json.dumps({**config, **changes}))
        return str(copy)

    with pytest.raises(ValueError, match="needs model.path: a local diffusers folder"):
        load_model(CARD, path=None)
    with pytest.raises(ValueError, match="Wan2.2"):
        load_model(CARD, path=variant("wan22", "model_index.json", boundary_ratio=0.9))
    with pytest.raises(ValueError, match="Wan2.2"):
        load_model(CARD, path=variant("ti2v", "model_index.json", expand_timesteps=True))
    with pytest.raises(ValueError, match="WanPipeline folder"):
        load_model(CARD, path=variant("t2v", "model_index.json", _class_name="WanPipeline"))
    with pytest.raises(ValueError, match="image_dim is null"):
        load_model(CARD, path=variant("no-image", "transformer/config.json", image_dim=None))
    with pytest.raises(ValueError, match="FLF2V"):
        load_model(CARD, path=variant("flf2v", "transformer/config.json", pos_embed_seq_len=10))
    with pytest.raises(ValueError, match="multiples of 16") as err:
        load_model(CARD, path=str(folder)).latent_shape(24, 32, 5)
    assert CARD in str(err.value)


def test_a_request_without_an_image_and_an_image_on_a_text_only_card_are_errors(model, images, tmp_path):
    engine = Engine(model)
    with pytest.raises(ValueError, match=r"request 1 has no image: card 'wan2\.1-i2v' is conditioned on one"):
        engine.generate([requests(images, 2.0)[0], GenerationRequest(prompt="x", seed=0, card=CARD, **SIZE)])
    toy = Engine(load_model("toy-digits"))
    with pytest.raises(ValueError, match="takes no image"):
        toy.generate([GenerationRequest(prompt="a 3", seed=0, card="toy-digits", image=images[0])])
    with pytest.raises(FileNotFoundError, match=r"first-frame image '.*nowhere\.png' does not exist"):
        engine.generate(requests([str(tmp_path / "nowhere.png")] * 3, 2.0))
    # A training forward handed conditioning without the first frame (a trajectory of another card) is named.
    text_only = engine.encode_prompts(PROMPTS[:1])
    with pytest.raises(ValueError, match=r"no first frame .*got extra=None"):
        model.velocity(model.transformer, torch.zeros(1, 16, 2, 2, 4), 0.5, text_only)
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a picture")
    with pytest.raises(ValueError, match=r"cannot read the first-frame image '.*notes\.png'"):
        engine.generate(requests([str(not_an_image)] * 3, 2.0))


# ---- parity with WanImageToVideoPipeline ------------------------------------------------------


@pytest.mark.parametrize("guidance", [5.0, 2.0])
def test_ode_rollout_equals_the_stock_pipeline_with_three_first_frames(model, stock, images, guidance):
    engine = Engine(model)
    traj = engine.generate(requests(images, guidance))
    expected = stock_latents(stock, engine, images, 4, guidance)
    assert traj.latents[:, -1].shape == expected.shape == (3, 16, 2, 2, 4)
    assert (traj.latents[:, -1] - expected).abs().max() <= 1e-5
    assert tuple(traj.images.shape) == (3, 3, 5, 16, 32) and 0 <= traj.images.min() and traj.images.max() <= 1

    # The conditioning the trajectory carries: the pipeline's own CLIP embedding of each image, and the mask
    # (the first latent frame, all four of its channels) before the image latents.
    extra = traj.condition_extra
    with torch.no_grad():
        embeds = stock.encode_image([Image.open(p).convert("RGB") for p in images], "cpu")
    assert torch.equal(extra["image_embeds"], embeds.float())
    assert extra["condition"].shape == (3, 20, 2, 2, 4)
    assert (extra["condition"][:, :4, 0] == 1).all() and (extra["condition"][:, :4, 1:] == 0).all()
    # The image matters: the same prompts and seeds with the frames rotated give other videos.
    rotated = engine.generate(requests(images[1:] + images[:1], guidance))
    assert (rotated.latents[:, -1] - traj.latents[:, -1]).abs().max() > 1e-2


def test_each_distinct_image_is_encoded_once_and_rows_get_their_own(model, images):
    """A GRPO group shares its first frame: the batch encodes it once and hands every row its copy."""
    calls = []
    original = model.pipe.encode_image

    def counted(images_in, device):
        calls.append(len(images_in))
        return original(images_in, device)

    model.pipe.encode_image = counted
    try:
        shape = model.latent_shape(SIZE["height"], SIZE["width"], SIZE["frames"])
        extra = model.encode_images([images[0], images[1], images[0], images[1]], shape)
        single = model.encode_images([images[1]], shape)
    finally:
        del model.pipe.encode_image
    assert calls == [2, 1]
    for name in ("condition", "image_embeds"):
        assert torch.equal(extra[name][0], extra[name][2]) and torch.equal(extra[name][1], extra[name][3])
        torch.testing.assert_close(extra[name][1:2], single[name], rtol=0, atol=1e-6)


def test_sde_rollout_recomputed_with_the_trajectorys_conditioning_is_on_policy(model, images):
    """Training forwards rebuild the first-frame conditioning from the trajectory (trajectory_conditioning):
    the recomputed log-probs of every step equal the rollout's, so the first ratio is exactly 1."""
    from engine.denoise import guided_velocity
    from engine.sampling import sde_t_cap, step_log_prob
    from flywheel.recipe.update import trajectory_conditioning

    traj = Engine(model).generate(requests(images, 3.0, steps=3, sampler="sde", noise_level=0.7))
    cond, uncond_cond = trajectory_conditioning(traj, use_cfg=True)
    assert torch.equal(uncond_cond.extra["condition"], traj.condition_extra["condition"].repeat(2, 1, 1, 1, 1))
    for j in range(traj.num_steps):
        t, t_next = traj.timesteps[j], traj.timesteps[j + 1]
        with torch.no_grad():
            v = guided_velocity(model, model.transformer, traj.latents[:, j], t, cond, uncond_cond, 3.0)
        log_prob, _, _ = step_log_prob(traj.sampler, traj.latents[:, j], traj.latents[:, j + 1], v, t, t_next,
                                       traj.levels_at(j), sde_t_cap(traj.timesteps))
        torch.testing.assert_close(log_prob, traj.log_probs[:, j], rtol=0, atol=1e-5)
    assert (traj.log_probs[:, :2] != 0).all()


def test_denoise_loop_with_the_first_frame_makes_no_host_transfers(model, images):
    """The conditioning is encoded once, before the loop; inside it the velocity only concatenates tensors."""
    from engine import forbid_host_transfers
    from engine.denoise import concat_embeds, denoise
    from engine.sampling import step_noise_levels

    engine = Engine(model)
    shape = model.latent_shape(SIZE["height"], SIZE["width"], SIZE["frames"])
    extra = model.encode_images(images, shape)
    cond = engine.encode_prompts(PROMPTS)._replace(extra=extra)
    uncond_cond = concat_embeds(engine.encode_prompts([""] * 3)._replace(extra=extra), cond)
    timesteps = engine.schedule(2, shape)
    with forbid_host_transfers():
        latents, log_probs = denoise(model, model.transformer, torch.randn(3, *shape), torch.randn(3, 2, *shape),
                                     timesteps, step_noise_levels(2, "sde", 0.7), cond, uncond_cond, 3.0)
    assert torch.isfinite(latents).all() and torch.isfinite(log_probs).all()


# ---- LoRA: the stock pipeline's load_lora_weights reproduces the engine ---------------------


def engine_and_stock_with_lora(model, stock, images, lora_dir, adapter):
    """(engine base, engine tuned, stock base, stock tuned) final latents at guidance 2, three steps."""
    model.transformer.load_state_dict(adapter, strict=False)
    engine = Engine(model)
    tuned = engine.generate(requests(images, 2.0, steps=3)).latents[:, -1]
    with adapters_disabled(model.transformer):
        base = engine.generate(requests(images, 2.0, steps=3)).latents[:, -1]
    stock_base = stock_latents(stock, engine, images, 3, 2.0)
    stock.load_lora_weights(str(lora_dir))
    try:
        stock_tuned = stock_latents(stock, engine, images, 3, 2.0)
    finally:
        stock.unload_lora_weights()
    return base, tuned, stock_base, stock_tuned


def test_a_lora_saved_for_diffusers_loads_into_the_stock_pipeline_and_gives_the_engines_output(
        folder, stock, images, tmp_path):
    model = load_model(CARD, path=str(folder))
    names = add_lora(model.transformer, 4, 8, get_card(CARD).defaults["lora_targets"])
    assert any("add_k_proj" in n for n in names)
    g = torch.Generator().manual_seed(7)
    adapter = {n: 0.3 * torch.randn(p.shape, generator=g) for n, p in model.transformer.named_parameters()
               if n in names}
    model.transformer.load_state_dict(adapter, strict=False)  # lora_B starts at zero: make the adapter count
    save_lora_for_diffusers(model.transformer, tmp_path / "lora", "WanImageToVideoPipeline")
    base, tuned, stock_base, stock_tuned = engine_and_stock_with_lora(model, stock, images, tmp_path / "lora", adapter)
    assert (stock_base - base).abs().max() <= 1e-5
    assert (tuned - base).abs().max() > 1e-2  # the adapter matters...
    assert (stock_tuned - tuned).abs().max() <= 1e-5  # ...and the same way in the stock pipeline


# ---- prompt datasets with first frames --------------------------------------------------------


def test_jsonl_images_resolve_against_the_dataset_folder_and_missing_ones_are_named(images, tmp_path):
    data = tmp_path / "data"
    (data / "frames").mkdir(parents=True)
    shutil.copy(images[0], data / "frames" / "a.png")
    rows = [{"prompt": "a cat", "image": "frames/a.png", "tag": 1}, {"prompt": "a dog", "image": images[1]},
            {"prompt": "no image here"}]
    dataset = data / "train.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_prompts(str(dataset))
    assert items[0].metadata == {"image": str((data / "frames" / "a.png").resolve()), "tag": 1}
    assert items[1].metadata["image"] == str(Path(images[1]).resolve())
    assert items[2].metadata == {}

    broken = data / "broken.jsonl"
    broken.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "ok", "image": "frames/a.png"}, {"prompt": "gone", "image": "frames/gone.png"},
        {"prompt": "also gone", "image": "/nowhere/b.png"}]) + "\n")
    with pytest.raises(FileNotFoundError) as err:
        load_prompts(str(broken))
    message = str(err.value)
    assert "2 image(s) not found" in message and str(data) in message
    assert "line 2: 'frames/gone.png'" in message and "line 3: '/nowhere/b.png'" in message
    assert "line 1" not in message

    many = data / "many.jsonl"
    many.write_text("".join(json.dumps({"prompt": "p", "image": f"x{i}.png"}) + "\n" for i in range(13)))
    shown_last = rf"line {MISSING_IMAGES_SHOWN}: 'x{MISSING_IMAGES_SHOWN - 1}\.png'"
    with pytest.raises(FileNotFoundError, match=rf"13 image\(s\) not found.*{shown_last}[^;]*; and 3 more$"):
        load_prompts(str(many))
    for bad in ('""', "3", "null"):
        (data / "bad.jsonl").write_text('{"prompt": "p", "image": ' + bad + "}\n")
        with pytest.raises(ValueError, match=r"bad\.jsonl:1: \"image\" must be a non-empty path string"):
            load_prompts(str(data / "bad.jsonl"))


# ---- the engine process carries the conditioning ----------------------------------------------


@pytest.mark.slow
def test_engine_process_round_trip_carries_the_first_frame_conditioning(folder, model, images):
    from flywheel.sync.engine_process import EngineProcess

    local = Engine(model).generate(requests(images, 2.0, steps=2))
    remote_engine = EngineProcess.start(CARD, path=str(folder))
    try:
        remote = remote_engine.generate(requests(images, 2.0, steps=2))
    finally:
        remote_engine.close()
    assert set(remote.condition_extra) == {"condition", "image_embeds"}
    for name, value in local.condition_extra.items():
        assert torch.equal(remote.condition_extra[name], value)
    assert torch.equal(remote.latents, local.latents)
    # The per-row conditioning is sliced with the rows, as the trainer's minibatches slice the trajectory.
    assert torch.equal(remote.select([2]).condition_extra["image_embeds"], local.condition_extra["image_embeds"][2:])


# ---- GRPO with LoRA, first frames from the prompt dataset ------------------------------------


@pytest.fixture(scope="session")
def image_prompts(images, tmp_path_factory):
    """A .jsonl dataset whose rows name their first frame by a path relative to the dataset."""
    data = tmp_path_factory.mktemp("i2v-data")
    (data / "frames").mkdir()
    lines = []
    for prompt, path in zip(PROMPTS[:2], images[:2]):
        shutil.copy(path, data / "frames" / Path(path).name)
        lines.append(json.dumps({"prompt": prompt, "image": f"frames/{Path(path).name}"}))
    (data / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return data / "prompts.jsonl"


@pytest.mark.slow
def test_grpo_lora_run_on_first_frames_changes_the_adapter_and_loads_into_the_stock_pipeline(
        folder, stock, image_prompts, images, tmp_path):
    from safetensors.torch import load_file

    from flywheel.runs.checkpoint import latest_checkpoint
    from flywheel.runs.rundir import read_metrics
    from trainers.grpo import main

    run_dir = tmp_path / "run"
    main([f"run_dir={run_dir}", f"model.card={CARD}", f"model.path={folder}", "tracker=none", "steps=3",
          f"data.prompts={image_prompts}", f"data.eval_prompts={image_prompts}", "data.prompts_per_step=2",
          "data.group_size=2", "sampling.steps=2", "eval.seeds=1", "sampling.guidance_scale=2.0",
          "eval.guidance_scale=2.0", "reward.scorers=jpeg_compressibility:1.0", "eval.every=1000",
          "sample_every=3", "eval.steps=1", "train.kl_beta=0", "train.log_kl=false", "train.learning_rate=0.02",
          # 16x16: square halves the tiny VAE's work (the parity tests cover the non-square size)
          "sampling.height=16", "sampling.width=16", f"sampling.frames={SIZE['frames']}",
          "model.finetune=lora", "model.lora_rank=4", "model.lora_alpha=8"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["ratio/max_dev"] == 0  # the first update recomputes the rollout's own policy, image included
    trained = load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert lora_b and all("lora_" in k for k in trained)  # only the adapter was trained
    assert max(v.abs().max() for v in lora_b) > 0  # LoRA B starts at zero: the adapter changed
    assert any("add_k_proj" in k and v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)
    assert len(list((run_dir / "samples").glob("*.mp4"))) == 4  # two prompts, at the start and the end

    model = load_model(CARD, path=str(folder))
    add_lora(model.transformer, 4, 8, get_card(CARD).defaults["lora_targets"])
    base, tuned, stock_base, stock_tuned = engine_and_stock_with_lora(model, stock, images, run_dir / "lora", trained)
    assert (stock_base - base).abs().max() <= 1e-5
    assert (tuned - base).abs().max() > 1e-4
    assert (stock_tuned - tuned).abs().max() <= 1e-5
