"""The `qwen-image` card on a tiny random QwenImagePipeline folder built from configs.

The folder (a one-layer Qwen2.5-VL text encoder, a byte-level Qwen2 tokenizer,
a one-block transformer of width 32 and a 2x VAE) is written once per session
and loaded through the card's loader. Parity runs the engine's loop against
the stock pipeline's own __call__, fed the pipeline's own prompt embeddings
(each CFG branch padded to its own length, as the pipeline does) and the
engine's initial noise; the GRPO run trains a LoRA for three steps and checks
that the saved adapter changes the stock pipeline's output exactly as the engine's.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import Engine, GenerationRequest, get_card, list_cards, load_model
from flywheel.lora import adapters_disabled, add_lora
from flywheel.runs.checkpoint import latest_checkpoint
from flywheel.runs.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CARD = "qwen-image"
# Non-square (12 x 20 latents: 6 x 10 packed tokens); prompts of different token counts.
SIZE = dict(height=24, width=40)
PROMPTS = ["a red cat", "a shop sign that says OPEN 24 HOURS", "x"]
NEGATIVES = ["blurry", "", "low quality, watermark"]
SEEDS = (3, 11, 4)


@pytest.fixture(scope="session")
def qwen_folder(tmp_path_factory):
    from tiny_models.qwen_image import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("tiny-qwen-image") / "qwen-image")


@pytest.fixture(scope="session")
def qwen_model(qwen_folder):
    return load_model(CARD, path=str(qwen_folder))


def stock_pipeline(folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw_noise(seeds, shape):
    """Initial noise as the engine draws it: one generator per request seed, initial noise first."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


def requests(steps, guidance, sampler="ode", **kwargs):
    # Negative prompts only under CFG: at guidance 1 the engine refuses them (the pipeline ignores them there).
    return [GenerationRequest(prompt=p, negative_prompt=n if guidance != 1.0 else "", seed=s, card=CARD, steps=steps, sampler=sampler,
                              guidance_scale=guidance, **SIZE, **kwargs)
            for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS)]


def pipeline_latents(pipe, noise, steps, guidance):
    """Final latents [B, C, H', W'] of QwenImagePipeline.__call__ on its own prompt embeddings (each branch
    padded to its own longest prompt, with its mask) and the given unpacked noise."""
    from engine.families.flux import pack_latents, unpack_latents

    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(PROMPTS, device="cpu")
        negative = dict(negative_prompt_embeds=None, negative_prompt_embeds_mask=None)
        if guidance > 1:
            neg_embeds, neg_mask = pipe.encode_prompt(NEGATIVES, device="cpu")
            negative = dict(negative_prompt_embeds=neg_embeds, negative_prompt_embeds_mask=neg_mask)
        out = pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, **negative, true_cfg_scale=guidance,
                   latents=pack_latents(noise), num_inference_steps=steps, output_type="latent", **SIZE).images
    return unpack_latents(out.float(), *noise.shape[1:])


# ---- registration and folders ------------------------------------------------------------------

def test_card_is_registered_without_importing_diffusers():
    assert CARD in list_cards()
    defaults = get_card(CARD).defaults
    assert defaults["diffusers_pipeline"] == "QwenImagePipeline" and defaults["video"] is False
    assert "attn.add_q_proj" in defaults["lora_targets"]  # the text stream of the joint blocks too
    code = "import sys, engine; assert 'qwen-image' in engine.list_cards(); print('diffusers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_incomplete_folder_is_an_error_listing_what_is_missing(qwen_folder, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen_folder, broken)
    shutil.rmtree(broken / "tokenizer")
    (broken / "text_encoder" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_model(CARD, path=str(broken))
    message = str(err.value)
    assert "tokenizer/" in message and "text_encoder/*.safetensors" in message
    assert "vae/" not in message and "transformer/" not in message  # present components are not listed
    with pytest.raises(ValueError, match="model.path"):
        load_model(CARD, path=None)


def test_a_guidance_distilled_transformer_is_refused(qwen_folder, tmp_path):
    folder = tmp_path / "distilled"
    shutil.copytree(qwen_folder, folder)
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "guidance_embeds": True}))
    with pytest.raises(ValueError, match="guidance_embeds"):
        load_model(CARD, path=str(folder))


def test_latent_shape_and_size_errors(qwen_model):
    assert qwen_model.latent_shape(24, 40, None) == (4, 12, 20)
    assert qwen_model.latent_shape(None, None, None) == (4, 128, 128)  # the pipeline's 128 latent pixels
    with pytest.raises(ValueError, match="multiples of 4"):
        qwen_model.latent_shape(24, 42, None)
    with pytest.raises(ValueError, match="frames"):
        qwen_model.latent_shape(24, 40, 5)


# ---- prompts: padding and mask -----------------------------------------------------------------

def test_prompts_are_the_pipelines_embeddings_padded_to_a_fixed_length_with_their_mask(qwen_folder, qwen_model):
    pipe = stock_pipeline(qwen_folder)
    with torch.no_grad():
        expected, expected_mask = pipe.encode_prompt(PROMPTS, device="cpu")
        cond = qwen_model.encode_prompts(PROMPTS)
        alone = qwen_model.encode_prompts(PROMPTS[2:])
    lengths = expected_mask.sum(1)
    assert len(set(lengths.tolist())) == 3  # three different token counts: the padding is exercised
    assert cond.embeds.shape == (3, qwen_model.max_sequence_length, 32) and cond.pooled.shape == (3, 0)
    assert cond.mask.dtype == torch.bool
    assert torch.equal(cond.mask.sum(1), lengths)
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(cond.embeds[i, :n], expected[i, :n]) and not cond.embeds[i, n:].any()
        assert cond.mask[i, :n].all() and not cond.mask[i, n:].any()
    # A prompt's row does not depend on its batch neighbours (the engine caches prompts one by one).
    n = int(lengths[2])
    assert (alone.embeds[0, :n] - cond.embeds[2, :n]).abs().max() <= 1e-5


# ---- CFG: the guide hook -----------------------------------------------------------------------

def test_guide_is_true_cfg_rescaled_to_the_conditional_norm_per_packed_token(qwen_model):
    """Worked by hand on one channel, a 2 x 4 latent = two packed tokens of 4 values (one 2x2 patch each).

    token 0: v_c = (2, 1, 2, 0), ‖v_c‖ = 3; v_u = (2, -2, 0, 0); g = 2 -> comb = v_u + 2(v_c - v_u)
             = (2, 4, 4, 0), ‖comb‖ = 6 -> comb · 3/6 = (1, 2, 2, 0).
    token 1: v_c = v_u = (0, 0, 0, 5) -> comb = v_c, unchanged.
    A token's 4 values are its patch (row 0: columns 2j, 2j+1; then row 1). A norm over the channel
    alone, over the whole latent, or no rescale gives other numbers.
    """
    v_cond = torch.tensor([[[[2.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 5.0]]]])
    v_uncond = torch.tensor([[[[2.0, -2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]]]])
    expected = torch.tensor([[[[1.0, 2.0, 0.0, 0.0], [2.0, 0.0, 0.0, 5.0]]]])
    torch.testing.assert_close(qwen_model.guide(v_uncond, v_cond, 2.0), expected, rtol=0, atol=1e-6)
    # As the pipeline: CFG only above 1; at or below it the conditional velocity.
    assert torch.equal(qwen_model.guide(v_uncond, v_cond, 1.0), v_cond)
    assert torch.equal(qwen_model.guide(v_uncond, v_cond, 0.5), v_cond)


# ---- parity with the stock pipeline ------------------------------------------------------------

@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_engine_ode_rollout_equals_the_stock_pipeline(qwen_folder, qwen_model, guidance):
    """Non-square, 3 prompts of different lengths with different negative prompts, mixed seeds."""
    steps = 4
    traj = Engine(qwen_model).generate(requests(steps, guidance))
    pipe = stock_pipeline(qwen_folder)
    noise = draw_noise(SEEDS, qwen_model.latent_shape(SIZE["height"], SIZE["width"], None))
    expected = pipeline_latents(pipe, noise, steps, guidance)
    assert traj.latents[:, -1].shape == expected.shape == (3, 4, 12, 20)
    assert (traj.latents[:, -1] - expected).abs().max() <= 1e-5
    assert expected.abs().max() > 1.0  # not a trivially small output
    # The engine stepped on the pipeline's own (resolution-shifted, terminal-stretched) sigmas.
    torch.testing.assert_close(traj.timesteps, pipe.scheduler.sigmas.float(), rtol=0, atol=0)
    assert traj.images.shape == (3, 3, 24, 40) and 0.0 <= traj.images.min() and traj.images.max() <= 1.0


def test_decode_equals_the_pipelines_images(qwen_folder, qwen_model):
    """The VAE's per-channel mean/std and the frame axis: the engine's images equal the end of the pipeline's
    __call__ (unpack, x / (1 / std) + mean, decode frame 0, postprocess to [0, 1]) on the same latents."""
    from engine.families.flux import pack_latents

    pipe = stock_pipeline(qwen_folder)
    latents = draw_noise((5, 6), (4, 12, 20))
    z = pipe.vae.config.z_dim
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1)
    with torch.no_grad():
        images = qwen_model.decode(latents)
        unpacked = pipe._unpack_latents(pack_latents(latents), 24, 40, pipe.vae_scale_factor)
        stock = pipe.vae.decode(unpacked / inv_std + mean, return_dict=False)[0][:, :, 0]
        stock = pipe.image_processor.postprocess(stock, output_type="pt")
        skipped = qwen_model.vae.decode(latents.unsqueeze(2), return_dict=False)[0][:, :, 0]  # no normalisation
    assert images.shape == (2, 3, 24, 40)
    assert (images - stock).abs().max() <= 1e-6
    assert (images - (skipped / 2 + 0.5).clamp(0, 1)).abs().max() > 1e-2  # the normalisation matters


def test_sde_rollout_has_finite_log_probs_and_level_zero_is_the_ode(qwen_model):
    engine = Engine(qwen_model)
    traj = engine.generate(requests(3, 4.0, sampler="sde", noise_level=1.2))
    assert traj.latents.shape == (3, 4, 4, 12, 20) and traj.log_probs.shape == (3, 3)
    assert torch.isfinite(traj.log_probs).all() and (traj.log_probs[:, :2] != 0).all()
    assert traj.prompt_mask.shape == traj.negative_prompt_mask.shape == (3, qwen_model.max_sequence_length)
    ode = engine.generate(requests(3, 4.0))
    level_zero = engine.generate(requests(3, 4.0, sampler="sde", noise_level=0.0))
    assert torch.equal(level_zero.latents[:, -1], ode.latents[:, -1])


def test_denoise_loop_makes_no_host_transfers(qwen_model):
    from engine import forbid_host_transfers
    from engine.denoise import concat_embeds, denoise
    from engine.sampling import step_noise_levels

    engine = Engine(qwen_model)
    shape = qwen_model.latent_shape(SIZE["height"], SIZE["width"], None)
    timesteps = engine.schedule(2, shape)
    cond = engine.encode_prompts(PROMPTS[:2])
    uncond_cond = concat_embeds(engine.encode_prompts(NEGATIVES[:2]), cond)
    with forbid_host_transfers():
        latents, log_probs = denoise(qwen_model, qwen_model.transformer, torch.randn(2, *shape),
                                     torch.randn(2, 2, *shape), timesteps, step_noise_levels(2, "sde", 1.2), cond,
                                     uncond_cond, 4.0)
    assert torch.isfinite(latents).all() and torch.isfinite(log_probs).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # diffusers' 0/0 for one step
def test_schedule_is_the_pipelines_resolution_shifted_grid(qwen_model):
    """Worked by hand for 4 steps at 8 x 8 latents = 16 packed tokens, the tiny scheduler's base_image_seq_len,
    so mu = base_shift = 0.5. Grid linspace(1, 1/4, 4) = (1, .75, .5, .25); exponential shift
    s' = e^mu / (e^mu + 1/s - 1) = (1, .83183, .62246, .35466); shift_terminal 0.02 stretches 1 - s' by
    (1 - .35466) / .98 = .65851: s'' = 1 - (1 - s') / .65851 = (1, .74462, .42667, .02), then the final 0."""
    small, large = qwen_model.schedule(4, (4, 8, 8)), qwen_model.schedule(4, (4, 32, 32))
    torch.testing.assert_close(small, torch.tensor([1.0, 0.74462, 0.42667, 0.02, 0.0]), rtol=0, atol=2e-5)
    assert large[0] == 1.0 and large[-2] == pytest.approx(0.02) and large[-1] == 0.0
    assert (large[1:-2] > small[1:-2]).all()  # more tokens -> a larger mu -> more time near noise
    with pytest.raises(ValueError, match="steps >= 2"):  # one step: shift_terminal divides 0 by 0
        qwen_model.schedule(1, (4, 8, 8))


# ---- GRPO with LoRA, and the adapter in the stock pipeline --------------------------------------

@pytest.mark.slow
def test_grpo_lora_run_and_the_saved_lora_loads_into_the_stock_pipeline(qwen_folder, tmp_path):
    from trainers.grpo import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    run_dir = tmp_path / "run"
    main([f"run_dir={run_dir}", f"model.card={CARD}", f"model.path={qwen_folder}", "tracker=none", "steps=3",
          f"data.prompts={prompts}", f"data.eval_prompts={prompts}", "data.prompts_per_step=2", "data.group_size=2",
          "sampling.steps=2", "eval.seeds=1", "sampling.guidance_scale=2.0",
          "eval.guidance_scale=2.0", "reward.scorers=jpeg_compressibility:1.0", "eval.every=1000",
          "sample_every=1000", "eval.steps=2", "train.kl_beta=0", "train.log_kl=false", "train.learning_rate=0.02",
          f"sampling.height={SIZE['height']}", f"sampling.width={SIZE['width']}",
          "model.finetune=lora", "model.lora_rank=4", "model.lora_alpha=8", "train.gradient_checkpointing=true"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # Training's forward (masks and CFG branches rebuilt from the trajectory) recomputes the rollout's
    # log-probs: the first update is on-policy.
    assert rows[1]["ratio/max_dev"] < 1e-5
    trained = load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert lora_b and all("lora_" in k for k in trained)  # only the adapter was trained
    assert max(v.abs().max() for v in lora_b) > 0  # LoRA B starts at zero: the adapter changed

    model = load_model(CARD, path=str(qwen_folder))
    add_lora(model.transformer, 4, 8, get_card(CARD).defaults["lora_targets"])
    assert not model.transformer.load_state_dict(trained, strict=False).unexpected_keys
    engine = Engine(model)
    tuned = engine.generate(requests(3, 2.0)).latents[:, -1]
    with adapters_disabled(model.transformer):
        base = engine.generate(requests(3, 2.0)).latents[:, -1]

    pipe = stock_pipeline(qwen_folder)
    noise = draw_noise(SEEDS, tuple(base.shape[1:]))
    stock_base = pipeline_latents(pipe, noise, 3, 2.0)
    pipe.load_lora_weights(str(run_dir / "lora"))
    stock_tuned = pipeline_latents(pipe, noise, 3, 2.0)
    assert (stock_base - base).abs().max() <= 1e-5
    assert (tuned - base).abs().max() > 1e-3  # the adapter matters...
    assert (stock_tuned - tuned).abs().max() <= 1e-5  # ...and the same way in the stock pipeline


def test_qwen_image_ocr_config_follows_verls_published_run(qwen_model):
    """configs/qwen_image_ocr.yaml says it follows verl's run_qwen_image_ocr_lora.sh (commit 2456339) and the
    defaults it leaves to diffusion_rollout.yaml / diffusion_actor.yaml; its LoRA targets exist in the model."""
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    cfg = parse_config(Config, ["--config", str(ROOT / "configs" / "qwen_image_ocr.yaml")])
    verl = {  # verl's key -> (its value, ours)
        "data.train_batch_size": (32, cfg.data.prompts_per_step), "rollout.n": (16, cfg.data.group_size),
        "optim.lr": (3e-4, cfg.train.learning_rate), "optim.weight_decay": (1e-4, cfg.train.weight_decay),
        "lora_rank": (64, cfg.model.lora_rank), "lora_alpha": (128, cfg.model.lora_alpha),
        "true_cfg_scale": (4.0, cfg.sampling.guidance_scale), "algo.noise_level": (1.2, cfg.sampling.noise_level),
        "algo.sde_type": ("sde", cfg.sampling.sampler), "algo.sde_window_size": (2, cfg.train.window_size),
        "algo.sde_window_range": ((0, 5), tuple(cfg.train.window_range)),
        "num_inference_steps": (10, cfg.sampling.steps), "val num_inference_steps": (50, cfg.eval.steps),
        "height x width": ((512, 512), (cfg.sampling.height, cfg.sampling.width)),
        "clip_ratio": (1e-4, cfg.train.clip_range), "adv_clip_max": (5.0, cfg.advantage.clip_max),
        "use_kl_loss": (False, cfg.train.kl_beta > 0), "model_dtype": ("bfloat16", cfg.model.dtype),
        "mini batches per step (32 / 16 prompts)": (2, cfg.train.updates_per_rollout),
        "micro batch": (16, cfg.train.minibatch_size), "total_training_steps": (300, cfg.steps),
        "max_sequence_length": (256, qwen_model.max_sequence_length),
    }
    assert {k: ours for k, (_, ours) in verl.items()} == {k: theirs for k, (theirs, _) in verl.items()}
    assert cfg.model.card == CARD and cfg.train.variant == "fast"
    linear_names = [n for n, m in qwen_model.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in cfg.model.lora_targets:
        assert any(n.endswith("." + target) for n in linear_names), target
