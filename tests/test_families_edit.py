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
    import tiny_models.edit as tiny_edit

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
    flux = tmp_path / "flux"
    shutil.copytree(folders[KONTEXT], flux)
    index = json.loads((flux / "model_index.json").read_text())
    (flux / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="holds a FluxPipeline folder; this card loads a FluxKontextPipeline"):
        load_model(KONTEXT, path=str(flux))


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
    assert torch.equal(pack_latents(extra["image_latents"][:1]), packed)  # bit for bit: the same arithmetic

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
    from engine.denoise import guided_velocity
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
            "reward.scorers=jpeg_compressibility:1.0"]
    with pytest.raises(ConfigError, match=r"card 'flux-kontext' is conditioned on an image per prompt .*prompt\(s\) "
                                          r"1 have none"):
        main([f"run_dir={tmp_path / 'run1'}", f"data.prompts={text}", f"data.eval_prompts={text}", *args])
    data = image_dataset(tmp_path / "data", images)
    (tmp_path / "data" / "sources" / Path(images[1]).name).write_text("not a picture")  # row 2's file
    with pytest.raises(ConfigError, match=r"1 image\(s\) cannot be read as images: row 2: '.*source1\.png'"):
        main([f"run_dir={tmp_path / 'run2'}", f"data.prompts={data}", f"data.eval_prompts={data}", *args])
    assert not (tmp_path / "run1").exists() and not (tmp_path / "run2").exists()


# ---- editing rewards ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def clip_folder(tmp_path_factory):
    """A tiny random CLIPModel + character tokenizer + image processor, saved as a user's CLIP folder is."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-clip")
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz"))
    vocab = {tok: i for i, tok in enumerate(["<|startoftext|>", "<|endoftext|>"] + chars + [c + "</w>" for c in chars])}
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)
    CLIPModel(config).eval().save_pretrained(folder)
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def read_rgb(path) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)


def test_edit_consistency_is_the_clip_cosine_of_each_output_and_its_own_source(clip_folder, images):
    from rewards import RewardSet
    from rewards.edit import EditConsistency, EditInstructionClip

    scorer = EditConsistency(path=str(clip_folder), device="cpu")
    outputs = torch.rand(3, 3, 32, 64, generator=torch.Generator().manual_seed(2))
    metadata = [{"image": p} for p in images]
    scores = scorer(outputs, PROMPTS, metadata)
    # Independently: each source file read here, both sides embedded, their cosine.
    expected = torch.stack([F.cosine_similarity(scorer.image_embeds(outputs[i:i + 1]),
                                                scorer.image_embeds(read_rgb(p)[None]))[0]
                            for i, p in enumerate(images)])
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)
    # An output that is its source scores 1; the rows are scored against their own source, not another's.
    same = scorer(read_rgb(images[2])[None], PROMPTS[:1], metadata[2:])
    assert same.item() == pytest.approx(1.0, abs=1e-5)
    shuffled = scorer(outputs, PROMPTS, metadata[1:] + metadata[:1])
    assert (shuffled - scores).abs().max() > 1e-4
    with pytest.raises(ValueError, match=r"'edit_consistency' .*row\(s\) 1 have no metadata\['image'\]"):
        scorer(outputs[:2], PROMPTS[:2], [metadata[0], {}])

    instruction = EditInstructionClip(path=str(clip_folder), device="cpu")
    text = F.normalize(instruction.text_embeds(PROMPTS), dim=-1)
    torch.testing.assert_close(instruction(outputs, PROMPTS, metadata),
                               (instruction.image_embeds(outputs) * text).sum(-1), rtol=0, atol=1e-6)
    batch = RewardSet("edit_consistency:1.0", scorer_kwargs={"edit_consistency": {"path": str(clip_folder)}}).score(
        outputs, PROMPTS, metadata, 0)
    torch.testing.assert_close(batch.total, scores, rtol=0, atol=1e-6)


def test_a_requests_source_image_reaches_the_rewards_through_the_trajectory(models, images, clip_folder):
    """A request made in code (no dataset row) still hands its scorers the source: the engine writes the
    request's image into the row's metadata, beside what the metadata already holds."""
    from rewards.edit import EditConsistency

    traj = Engine(models[KONTEXT]).generate([
        GenerationRequest(prompt=PROMPTS[0], seed=1, card=KONTEXT, steps=1, image=images[0], **SIZE),
        GenerationRequest(prompt=PROMPTS[1], seed=2, card=KONTEXT, steps=1, image=images[1], metadata={"tag": 3},
                          **SIZE)])
    assert traj.metadata == [{"image": images[0]}, {"tag": 3, "image": images[1]}]
    scorer = EditConsistency(path=str(clip_folder), device="cpu")
    expected = torch.cat([F.cosine_similarity(scorer.image_embeds(traj.images[i:i + 1]),
                                              scorer.image_embeds(read_rgb(images[i])[None])) for i in range(2)])
    torch.testing.assert_close(scorer(traj.images, traj.prompts, traj.metadata), expected, rtol=0, atol=1e-6)


def test_vlm_judge_with_source_image_sends_the_source_before_the_edit(tmp_path):
    pytest.importorskip("openai", reason="vlm_judge needs the openai client: pip install -e .[vlm]")
    from rewards.digits import digit_split
    from rewards.vlm_judge import EDIT_TEMPLATES, VlmJudge
    from vlm_server import JudgeServer, decode

    x_train, _, y_train, _ = digit_split()
    outputs = torch.tensor(x_train[:2] / 16.0, dtype=torch.float32)[:, None].expand(-1, 3, -1, -1)
    sources = []
    for i in range(2):  # the source: the other digit, as an 8x8 PNG
        path = tmp_path / f"src{i}.png"
        Image.fromarray((outputs[1 - i].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(path)
        sources.append({"image": str(path)})
    prompts = [f"the digit {int(d)}" for d in y_train[:2]]
    with JudgeServer() as server:
        judge = VlmJudge(base_url=server.base_url, source_image=True)
        scores = judge(outputs, prompts, sources)
        assert torch.isfinite(scores).all()
        content = server.requests[-1]["messages"][-1]["content"]
        sent = [decode(part["image_url"]["url"]) for part in content if part["type"] == "image_url"]
        assert len(sent) == 2
        torch.testing.assert_close(sent[0], read_rgb(sources[1]["image"]), rtol=0, atol=0)  # the source first
        torch.testing.assert_close(sent[1], outputs[1], rtol=0, atol=1 / 255)  # then the edit
        assert content[-1]["text"] == EDIT_TEMPLATES["yes_no"].format(prompt=prompts[1])
        with pytest.raises(ValueError, match=r"'vlm_judge' .*row\(s\) 0 have no metadata\['image'\]"):
            judge(outputs[:1], prompts[:1], [{}])


# ---- GRPO and NFT with LoRA on editing datasets --------------------------------------------------


@pytest.fixture(scope="session")
def edit_prompts(images, tmp_path_factory):
    return image_dataset(tmp_path_factory.mktemp("edit-data"), images)


def run_args(card, folder, data, run_dir, *extra):
    return [f"run_dir={run_dir}", f"model.card={card}", f"model.path={folder}", "tracker=none", "steps=3",
            f"data.prompts={data}", f"data.eval_prompts={data}", "data.prompts_per_step=2", "data.group_size=2",
            "sampling.steps=2", "eval.steps=2", "eval.seeds=1", "eval.every=1000",
            "sample_every=3", "save_every=3", "model.finetune=lora", "model.lora_rank=4", "model.lora_alpha=8",
            "sampling.height=16", "sampling.width=32", *extra]


@pytest.mark.parametrize("card", list(CARDS))
@pytest.mark.parametrize("recipe", ["grpo", "nft"])
def test_grpo_and_nft_lora_runs_on_source_images_change_the_adapter(card, recipe, folders, edit_prompts, clip_folder,
                                                                     tmp_path, monkeypatch):
    """Three LoRA steps scored by edit_consistency, which reads each row's source from the dataset (so the
    source reaches the reward through the loop); the adapter moves and the first GRPO update is on-policy."""
    import importlib
    import math

    from safetensors.torch import load_file

    from flywheel.runs.checkpoint import latest_checkpoint
    from flywheel.runs.rundir import read_metrics

    monkeypatch.setenv("FLYWHEEL_CLIP_PATH", str(clip_folder))
    # DiffusionNFT samples CFG-free (guidance 1; for Kontext the embedded scale 1); GRPO at the card's guidance.
    guidance = CARDS[card][2][0] if recipe == "grpo" else 1.0
    extra = [f"sampling.guidance_scale={guidance}", f"eval.guidance_scale={CARDS[card][2][0]}",
             "reward.scorers=edit_consistency:1.0"]
    if recipe == "grpo":
        extra += ["train.learning_rate=0.02", "train.kl_beta=0", "train.log_kl=false"]
    run_dir = tmp_path / "run"
    importlib.import_module(f"trainers.{recipe}").main(run_args(card, folders[card], edit_prompts, run_dir, *extra))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows[1:])
    assert all(-1 <= r["reward/edit_consistency/mean"] <= 1 for r in rows[1:])
    if recipe == "grpo":
        assert rows[1]["ratio/max_dev"] == 0  # the recompute reads the trajectory's source conditioning
    trained = load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert lora_b and all("lora_" in k for k in trained)  # only the adapter was trained
    assert max(v.abs().max() for v in lora_b) > 0  # LoRA B starts at zero: the adapter changed


# ---- a learning check for editing ------------------------------------------------------------------


class FlipCloseness:
    """Pixel reward: minus the mean squared distance of the output to the horizontal flip of its source."""

    name = "test_flip_closeness"

    def __call__(self, images, prompts, metadata):
        targets = torch.stack([read_rgb(m["image"]) for m in metadata]).flip(-1)
        return -(images.float().cpu() - targets).pow(2).flatten(1).mean(1)


def test_grpo_on_kontext_moves_outputs_toward_the_flipped_source_and_negated_advantages_away(folders, tmp_path,
                                                                                              monkeypatch):
    """Two sources (colour ramps, at the request's 16x32) and the instruction to mirror them; full fine-tuning
    of the tiny Kontext transformer, six GRPO steps, the evaluation the ODE on fixed seeds (so a change is the
    training's doing). Measured (2026-12-02, CPU): -0.151 -> -0.123 (real), -> -0.161 (negated)."""
    from rewards import registry
    from flywheel.runs.rundir import read_metrics
    from trainers.grpo import main

    from recipe_kill import negate_advantages

    lines = []
    (tmp_path / "src").mkdir()
    for i, prompt in enumerate(["flip it", "mirror it"]):
        ramp = np.zeros((16, 32, 3))
        ramp[..., i], ramp[..., 2] = np.linspace(0, 1, 32)[None, :], 0.5
        Image.fromarray((ramp * 255).astype(np.uint8)).save(tmp_path / "src" / f"{i}.png")
        lines.append(json.dumps({"prompt": prompt, "image": f"src/{i}.png"}))
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n")

    def args(run_dir):
        return [f"run_dir={run_dir}", f"model.card={KONTEXT}", f"model.path={folders[KONTEXT]}", "tracker=none",
                "steps=6", f"data.prompts={data}", f"data.eval_prompts={data}", "data.prompts_per_step=2",
                "data.group_size=4", "sampling.steps=2", "eval.steps=2", "eval.seeds=2",
                "eval.every=6", "sample_every=1000", "save_every=1000", "reward.scorers=test_flip_closeness:1.0",
                "sampling.height=16", "sampling.width=32", "model.finetune=full", "train.learning_rate=1e-2",
                "train.kl_beta=0", "train.timestep_fraction=1.0"]

    registry.register("test_flip_closeness", lambda **kwargs: FlipCloseness())
    try:
        main(args(tmp_path / "real"))
        negate_advantages(monkeypatch)
        main(args(tmp_path / "negated"))
    finally:
        registry.unregister("test_flip_closeness")
    real = read_metrics(tmp_path / "real" / "metrics.jsonl")
    control = read_metrics(tmp_path / "negated" / "metrics.jsonl")
    base = real[0]["eval/reward/mean"]
    assert control[0]["eval/reward/mean"] == base  # same seeds, same start
    assert real[-1]["eval/reward/mean"] > base + 0.01
    assert control[-1]["eval/reward/mean"] < base - 0.003
