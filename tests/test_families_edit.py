"""The editing cards `flux-kontext` and `qwen-image-edit-plus` on tiny random folders, and the editing rewards.

Each folder is written with `save_pretrained` once per session and loaded through
the card's loader. Parity runs the engine's ODE rollout (three rows, mixed seeds,
one batch) and the stock pipeline's own __call__ (one call per row: the Qwen
pipeline refuses batches, and each row has its own source image) on the same
weights, initial noise and source images, at a non-square size. The Kontext
pipeline is handed the engine's prompt embeddings and the source already
resized to the request's size (`_auto_resize=False`, `max_area=H·W`); the Qwen
pipeline encodes the prompts with the images itself (so its VLM path is
compared too), its VAE_IMAGE_SIZE set to H·W (the card takes the source's
latents at the request's size; the images have the request's 1:2 aspect ratio).
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from engine import Engine, GenerationRequest, get_card, list_cards, load_model
from flywheel.lora import adapters_disabled, add_lora, save_lora_for_diffusers

KONTEXT, QWEN = "flux-kontext", "qwen-image-edit-plus"
CARDS = {KONTEXT: ("build_tiny_flux_kontext", "FluxKontextPipeline", (3.5, 2.0)),
         QWEN: ("build_tiny_qwen_image_edit_plus", "QwenImageEditPlusPipeline", (4.0, 1.5))}
SIZE = dict(height=32, width=64)  # non-square: latents [4, 16, 32], 128 generated + 128 source tokens
PROMPTS = ["make it red", "add a blue dog", "turn it into hills"]
SEEDS = (3, 11, 5)
SOURCE_SIZES = [(20, 40), (40, 80), (32, 64)]  # (h, w): the request's aspect ratio at three sizes


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    import engine.families.tiny_edit as tiny_edit

    root = tmp_path_factory.mktemp("tiny-edit")
    return {card: getattr(tiny_edit, builder)(root / card) for card, (builder, _, _) in CARDS.items()}


@pytest.fixture(scope="session")
def models(folders):
    return {card: load_model(card, path=str(folder)) for card, folder in folders.items()}


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Three random RGB PNGs with distinct content, so the source shows in the output."""
    root = tmp_path_factory.mktemp("sources")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(SOURCE_SIZES):
        path = root / f"source{i}.png"
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(path)
        paths.append(str(path))
    return paths


def stock_pipeline(card, folder):
    import diffusers

    kwargs = {}
    if card == QWEN:  # without torchvision, transformers cannot build Qwen2VLProcessor: the card's stands in
        from engine.families.qwen_image_edit import load_vl_processor

        kwargs["processor"] = load_vl_processor(Path(folder) / "processor")
    pipe = getattr(diffusers, CARDS[card][1]).from_pretrained(str(folder), **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def stocks(folders):
    return {card: stock_pipeline(card, folder) for card, folder in folders.items()}


@pytest.fixture
def qwen_vae_size(monkeypatch):
    """The Qwen pipeline's VAE_IMAGE_SIZE at the request's area (see the module docstring)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", SIZE["height"] * SIZE["width"])


def requests(card, images, guidance, steps=3, sampler="ode", **kwargs):
    return [GenerationRequest(prompt=p, seed=s, card=card, steps=steps, sampler=sampler, guidance_scale=guidance,
                              image=image, **SIZE, **kwargs) for p, s, image in zip(PROMPTS, SEEDS, images)]


def stock_latents(card, pipe, engine, images, steps, guidance):
    """Final latents [3, C, h, w] of the stock pipeline's __call__, one call per row, fed the engine's initial
    noise (one generator per request seed) and the same source file."""
    from engine.families.flux import pack_latents, unpack_latents

    shape = engine.model.latent_shape(SIZE["height"], SIZE["width"], None)
    cond = engine.encode_prompts(PROMPTS) if card == KONTEXT else None
    rows = []
    for i, (seed, path) in enumerate(zip(SEEDS, images)):
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).unsqueeze(0)
        source = Image.open(path).convert("RGB")
        with torch.no_grad():
            if card == KONTEXT:
                out = pipe(image=pipe.image_processor.resize(source, SIZE["height"], SIZE["width"]),
                           prompt_embeds=cond.embeds[i:i + 1], pooled_prompt_embeds=cond.pooled[i:i + 1],
                           latents=pack_latents(noise), num_inference_steps=steps, guidance_scale=guidance,
                           max_area=SIZE["height"] * SIZE["width"], _auto_resize=False, output_type="latent",
                           **SIZE).images
            else:
                out = pipe(image=source, prompt=PROMPTS[i], negative_prompt="" if guidance > 1 else None,
                           true_cfg_scale=guidance, latents=pack_latents(noise), num_inference_steps=steps,
                           output_type="latent", **SIZE).images
        rows.append(unpack_latents(out.float(), *shape))
    return torch.cat(rows)


# ---- the cards ---------------------------------------------------------------------------------


@pytest.mark.parametrize("card", list(CARDS))
def test_cards_are_registered_as_image_conditioned_with_their_pipeline(card):
    assert card in list_cards()
    defaults = get_card(card).defaults
    assert defaults["diffusers_pipeline"] == CARDS[card][1] and defaults["image_conditioned"] is True
    assert defaults["video"] is False and "attn.add_q_proj" in defaults["lora_targets"]


def test_folder_errors_name_what_is_missing_or_of_another_pipeline(folders, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folders[QWEN], broken)
    shutil.rmtree(broken / "processor")
    with pytest.raises(FileNotFoundError, match=r"incomplete; missing: processor/ \(tokenizer\)$"):
        load_model(QWEN, path=str(broken))
    other = tmp_path / "other"
    shutil.copytree(folders[QWEN], other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImagePipeline"}))
    with pytest.raises(ValueError, match="holds a QwenImagePipeline folder; this card loads a QwenImageEditPlus"):
        load_model(QWEN, path=str(other))
    with pytest.raises(ValueError, match="needs model.path"):
        load_model(KONTEXT, path=None)


@pytest.mark.parametrize("card", list(CARDS))
def test_requests_without_or_with_unusable_source_images_are_errors(card, models, images, tmp_path):
    engine = Engine(models[card])
    with pytest.raises(ValueError, match=rf"request 1 has no image: card '{card}' is conditioned on one"):
        engine.generate([requests(card, images, 2.0)[0], GenerationRequest(prompt="x", seed=0, card=card, **SIZE)])
    with pytest.raises(FileNotFoundError, match=rf"{card}: the source image '.*nowhere\.png' does not exist"):
        engine.generate(requests(card, [str(tmp_path / "nowhere.png")] * 3, 2.0))
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a picture")
    with pytest.raises(ValueError, match=rf"{card}: cannot read the source image '.*notes\.png'"):
        engine.generate(requests(card, [str(not_an_image)] * 3, 2.0))
    model = models[card]
    shape = model.latent_shape(SIZE["height"], SIZE["width"], None)
    # A training forward handed conditioning without the source (a trajectory of another card) is named.
    cond = (engine.encode_prompts(PROMPTS[:1]) if card == KONTEXT
            else model.encode_prompts(PROMPTS[:1], images=images[:1]))
    with pytest.raises(ValueError, match=r"no source image .*got extra=None"):
        model.velocity(model.transformer, torch.zeros(1, *shape), 0.5, cond)
    if card == QWEN:  # its prompts cannot be embedded without their image
        with pytest.raises(ValueError, match="prompts are encoded with their source image"):
            model.encode_prompts(PROMPTS[:1])


# ---- parity with the stock pipelines -------------------------------------------------------------


@pytest.mark.parametrize("card, guidance", [(c, g) for c, (_, _, gs) in CARDS.items() for g in gs])
def test_ode_rollout_equals_the_stock_pipeline_with_three_source_images(card, guidance, models, stocks, images,
                                                                        qwen_vae_size):
    engine = Engine(models[card])
    traj = engine.generate(requests(card, images, guidance))
    expected = stock_latents(card, stocks[card], engine, images, 3, guidance)
    assert traj.latents[:, -1].shape == expected.shape == (3, 4, 16, 32)
    assert (traj.latents[:, -1] - expected).abs().max() <= 1e-5
    assert tuple(traj.images.shape) == (3, 3, 32, 64)
    # The source matters: the same prompts and seeds with the images rotated give other edits.
    rotated = engine.generate(requests(card, images[1:] + images[:1], guidance))
    assert (rotated.latents[:, -1] - traj.latents[:, -1]).abs().max() > 1e-3


@pytest.mark.parametrize("card", list(CARDS))
def test_source_latents_are_the_pipelines_and_only_the_generated_tokens_are_denoised(card, models, stocks,
                                                                                      images):
    from engine.families.flux import pack_latents

    model, pipe = models[card], stocks[card]
    shape = model.latent_shape(SIZE["height"], SIZE["width"], None)
    extra = model.encode_images(images, shape)
    pixels = pipe.image_processor.preprocess(Image.open(images[0]).convert("RGB"), SIZE["height"], SIZE["width"])
    with torch.no_grad():
        if card == KONTEXT:
            _, packed, _, ids = pipe.prepare_latents(pixels, 1, 4, SIZE["height"], SIZE["width"], torch.float32,
                                                     "cpu", None)
            # The source tokens' ids: the noisy tokens' (row, column) with the first coordinate 1.
            joint = model.joint_ids(*shape[-2:], torch.device("cpu"))
            assert torch.equal(joint[joint.shape[0] // 2:], ids) and (joint[:joint.shape[0] // 2, 0] == 0).all()
        else:
            _, packed = pipe.prepare_latents([pixels.unsqueeze(2)], 1, 4, SIZE["height"], SIZE["width"],
                                             torch.float32, "cpu", None)
    torch.testing.assert_close(pack_latents(extra["image_latents"][:1]), packed, rtol=0, atol=1e-6)

    # The velocity has the noisy latents' shape (the source's tokens are cut from the output), and it
    # depends on the source: they are read, not denoised.
    engine = Engine(model)
    cond = (engine.encode_prompts(PROMPTS) if card == KONTEXT else model.encode_prompts(PROMPTS, images=images))
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(model.transformer, x, 0.6, cond._replace(extra=extra))
        other = {"image_latents": extra["image_latents"].roll(1, 0)}
        v_other = model.velocity(model.transformer, x, 0.6, cond._replace(extra=other))
    assert v.shape == x.shape and (v - v_other).abs().max() > 1e-4


def test_qwen_prompts_are_read_with_their_image_and_bypass_the_text_cache(models, images):
    """The VLM embedding of a prompt depends on its source image, so rows with one prompt and two images get
    two embeddings, the trajectory carries them, and the engine's text-only cache is not used."""
    model = models[QWEN]
    engine = Engine(model)
    cond = model.encode_prompts([PROMPTS[0]] * 2, images=images[:2])
    assert cond.embeds.shape == (2, model.max_sequence_length, 32)
    assert (cond.embeds[0] - cond.embeds[1]).abs().max() > 1e-4
    assert torch.equal(cond.mask[:, 0], torch.tensor([True, True])) and not cond.mask[:, -1].any()
    traj = engine.generate([GenerationRequest(prompt=PROMPTS[0], seed=0, card=QWEN, steps=2, image=im, **SIZE,
                                              guidance_scale=1.0) for im in images[:2]])
    assert torch.equal(traj.prompt_embeds, cond.embeds) and len(engine.prompt_cache) == 0


@pytest.mark.parametrize("card", list(CARDS))
def test_sde_rollout_recomputed_with_the_trajectorys_conditioning_is_on_policy(card, models, images):
    """Training forwards rebuild the conditioning from the trajectory (its image-aware prompt embeddings and
    source latents): every step's recomputed log-prob equals the rollout's, so the first ratio is exactly 1."""
    from engine.loop import guided_velocity
    from engine.sampling import sde_t_cap, step_log_prob
    from flywheel.recipe.update import trajectory_conditioning

    model = models[card]
    guidance = CARDS[card][2][0]
    traj = Engine(model).generate(requests(card, images, guidance, sampler="sde", noise_level=0.7))
    use_cfg = card == QWEN
    cond, uncond_cond = trajectory_conditioning(traj, use_cfg=use_cfg)
    for j in range(traj.num_steps):
        t, t_next = traj.timesteps[j], traj.timesteps[j + 1]
        with torch.no_grad():
            v = guided_velocity(model, model.transformer, traj.latents[:, j], t, cond, uncond_cond, guidance)
        log_prob, _, _ = step_log_prob(traj.sampler, traj.latents[:, j], traj.latents[:, j + 1], v, t, t_next,
                                       traj.levels_at(j), sde_t_cap(traj.timesteps))
        torch.testing.assert_close(log_prob, traj.log_probs[:, j], rtol=0, atol=1e-5)
    assert (traj.log_probs[:, :2] != 0).all()


# ---- LoRA: the stock pipeline's load_lora_weights reproduces the engine --------------------------


def engine_and_stock_with_lora(card, model, stock, images, lora_dir, adapter):
    """(engine base, engine tuned, stock base, stock tuned) final latents, three steps."""
    guidance = CARDS[card][2][1]
    model.transformer.load_state_dict(adapter, strict=False)
    engine = Engine(model)
    tuned = engine.generate(requests(card, images, guidance)).latents[:, -1]
    with adapters_disabled(model.transformer):
        base = engine.generate(requests(card, images, guidance)).latents[:, -1]
    stock_base = stock_latents(card, stock, engine, images, 3, guidance)
    stock.load_lora_weights(str(lora_dir))
    try:
        stock_tuned = stock_latents(card, stock, engine, images, 3, guidance)
    finally:
        stock.unload_lora_weights()
    return base, tuned, stock_base, stock_tuned


@pytest.mark.parametrize("card", list(CARDS))
def test_a_lora_saved_for_diffusers_loads_into_the_stock_pipeline_and_gives_the_engines_output(
        card, folders, stocks, images, tmp_path, qwen_vae_size):
    model = load_model(card, path=str(folders[card]))
    names = add_lora(model.transformer, 4, 8, get_card(card).defaults["lora_targets"])
    g = torch.Generator().manual_seed(7)
    adapter = {n: 0.3 * torch.randn(p.shape, generator=g) for n, p in model.transformer.named_parameters()
               if n in names}
    save_lora_for_diffusers_after(model, adapter, tmp_path / "lora", CARDS[card][1])
    base, tuned, stock_base, stock_tuned = engine_and_stock_with_lora(card, model, stocks[card], images,
                                                                      tmp_path / "lora", adapter)
    assert (stock_base - base).abs().max() <= 1e-5
    assert (tuned - base).abs().max() > 1e-2  # the adapter matters...
    assert (stock_tuned - tuned).abs().max() <= 1e-5  # ...and the same way in the stock pipeline


def save_lora_for_diffusers_after(model, adapter, directory, pipeline):
    model.transformer.load_state_dict(adapter, strict=False)  # lora_B starts at zero: make the adapter count
    save_lora_for_diffusers(model.transformer, directory, pipeline)


# ---- prompt datasets with source images ------------------------------------------------------------


def image_dataset(root: Path, images, prompts=PROMPTS[:2]) -> Path:
    """A .jsonl whose rows name their source image by a path relative to the dataset."""
    (root / "sources").mkdir(parents=True, exist_ok=True)
    lines = []
    for prompt, path in zip(prompts, images):
        shutil.copy(path, root / "sources" / Path(path).name)
        lines.append(json.dumps({"prompt": prompt, "image": f"sources/{Path(path).name}"}))
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root / "prompts.jsonl"


def test_datasets_without_or_with_unreadable_images_are_config_errors_before_work(folders, images, tmp_path):
    from flywheel.runs.config import ConfigError
    from trainers.grpo import main

    text = tmp_path / "prompts.txt"
    text.write_text("make it red\n")
    args = [f"model.card={KONTEXT}", f"model.path={folders[KONTEXT]}", "tracker=none", "steps=1",
            "rewards=jpeg_compressibility:1.0"]
    with pytest.raises(ConfigError, match=r"card 'flux-kontext' is conditioned on an image per prompt .*prompt\(s\) "
                                          r"1 have none"):
        main([f"run_dir={tmp_path / 'run1'}", f"data.prompts={text}", f"data.eval_prompts={text}", *args])
    data = image_dataset(tmp_path / "data", images)
    (tmp_path / "data" / "sources" / Path(images[1]).name).write_text("not a picture")  # row 2's file
    with pytest.raises(ConfigError, match=r"1 image\(s\) cannot be read as images: row 2: '.*source1\.png'"):
        main([f"run_dir={tmp_path / 'run2'}", f"data.prompts={data}", f"data.eval_prompts={data}", *args])
    assert not (tmp_path / "run1").exists() and not (tmp_path / "run2").exists()
