"""The 2026 cards `flux2-klein`, `z-image` and `wan2.2-t2v` on tiny random folders built from configs.

Each folder is written once per session by `python tests/tiny_models`'s
builder and loaded through the card's loader. Parity runs the engine's ODE
against the stock pipeline's own __call__ on the engine's initial noise, at a
non-square size, with three prompts (different negative prompts) and mixed
seeds, at two guidance scales. The GRPO and NFT runs train a LoRA for three
steps; the GRPO run's saved adapter changes the stock pipeline's output
exactly as it changes the engine's.
"""

import dataclasses
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
from launched import run_process_group

ROOT = Path(__file__).resolve().parents[1]
CARDS = ("flux2-klein", "z-image", "wan2.2-t2v")
PIPELINES = {"flux2-klein": "Flux2KleinPipeline", "z-image": "ZImagePipeline", "wan2.2-t2v": "WanPipeline"}
SIZES = {"flux2-klein": dict(height=24, width=40), "z-image": dict(height=24, width=40),
         "wan2.2-t2v": dict(height=16, width=32, frames=5)}
PROMPTS = ["a red cat", "a shop sign that says OPEN 24 HOURS", "x"]
NEGATIVES = ["blurry", "", "low quality, watermark"]
SEEDS = (3, 11, 4)
# 4 UniPC steps on the tiny Wan2.2 folder (flow_shift 12): timesteps 999, 973, 923 (high-noise expert) and 800
# (low-noise): both experts run, none at the boundary (875).
STEPS = 4


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """Each card's tiny folder, written by the command users run (python tests/tiny_models)."""
    from tiny_models.folders import main

    root = tmp_path_factory.mktemp("tiny-2026")
    for card in CARDS:
        assert main(["--card", card, "--out", str(root / card)]) == 0
    return {card: root / card for card in CARDS}


@pytest.fixture(scope="session")
def models(folders):
    return {card: load_model(card, path=str(folders[card])) for card in CARDS}


@pytest.fixture(scope="session")
def stock(folders):
    """Each card's stock pipeline, loaded once for the tests that leave it unchanged (no LoRA loaded)."""
    return {card: stock_pipeline(card, folders[card]) for card in CARDS}


def stock_pipeline(card, folder):
    import diffusers

    pipe = getattr(diffusers, PIPELINES[card]).from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def draw_noise(seeds, shape):
    """Initial noise as the engine draws it: one generator per request seed, initial noise first."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


def requests(card, steps, guidance, sampler="ode", **kwargs):
    # Negative prompts only under CFG: at guidance 1 the engine refuses them (the pipelines ignore them there).
    return [GenerationRequest(prompt=p, negative_prompt=n if guidance != 1.0 else "", seed=s, card=card, steps=steps, sampler=sampler,
                              guidance_scale=guidance, **SIZES[card], **kwargs)
            for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS)]


def pipeline_latents(card, pipe, noise, steps, guidance):
    """The stock pipeline's final latents from `noise` (the engine's initial noise), in the engine's layout.

    flux2-klein: the pipeline takes only "" as a negative prompt text, so the negatives go in as its own
    embeddings; its latent output is the VAE's (de-normalised, patches unfolded), compared as such.
    z-image: the pipeline's guidance_scale is the engine's minus 1. Every pipeline gets copies of the prompt
    lists: ZImagePipeline writes its chat template into the list it is given.
    """
    with torch.no_grad():
        if card == "flux2-klein":
            negative = pipe.encode_prompt(list(NEGATIVES), device="cpu")[0]
            return pipe(prompt=list(PROMPTS), negative_prompt_embeds=negative, latents=noise, num_inference_steps=steps,
                        guidance_scale=guidance, output_type="latent", **SIZES[card]).images
        if card == "z-image":
            return pipe(prompt=list(PROMPTS), negative_prompt=list(NEGATIVES), latents=noise,
                        num_inference_steps=steps, guidance_scale=guidance - 1.0, output_type="latent", **SIZES[card]).images
        size = SIZES[card]
        return pipe(prompt=list(PROMPTS), negative_prompt=list(NEGATIVES), latents=noise,
                    num_inference_steps=steps, guidance_scale=guidance, output_type="latent", height=size["height"], width=size["width"],
                    num_frames=size["frames"]).frames


def engine_latents(card, model, traj):
    """The engine's final latents in the layout `pipeline_latents` returns."""
    final = traj.latents[:, -1]
    return model.to_vae_latents(final) if card == "flux2-klein" else final


# ---- registration, folders, sizes ----------------------------------------------------------------

def test_cards_are_registered_without_importing_diffusers():
    for card in CARDS:
        assert card in list_cards()
        defaults = get_card(card).defaults
        assert defaults["diffusers_pipeline"] == PIPELINES[card] and defaults["lora_targets"]
    assert get_card("wan2.2-t2v").defaults["experts"] == "both"
    code = ("import sys, engine; assert {'flux2-klein', 'z-image', 'wan2.2-t2v'} <= set(engine.list_cards()); "
            "print('diffusers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_tiny_folders_and_their_smoke_commands(folders):
    from tiny_models.folders import smoke_command

    for card in CARDS:
        assert (folders[card] / "model_index.json").is_file()
    assert (folders["wan2.2-t2v"] / "transformer_2" / "config.json").is_file()
    command = smoke_command("wan2.2-t2v", folders["wan2.2-t2v"])
    assert "model.card=wan2.2-t2v" in command and "sampling.frames=5" in command


def test_incomplete_folders_name_what_is_missing(folders, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(folders["wan2.2-t2v"], broken)
    shutil.rmtree(broken / "transformer_2")
    with pytest.raises(FileNotFoundError, match=r"transformer_2/ \(model\)"):
        load_model("wan2.2-t2v", path=str(broken))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_model("z-image", path=str(tmp_path / "nowhere"))


def test_a_wan21_folder_is_not_a_wan22_one(tmp_path):
    from tiny_models.core import build_tiny_wan

    folder = build_tiny_wan(tmp_path / "wan21")
    (folder / "transformer_2").mkdir()  # passes the folder check; the pipeline still has one expert
    (folder / "transformer_2" / "config.json").write_text((folder / "transformer" / "config.json").read_text())
    shutil.copy(next((folder / "transformer").glob("*.safetensors")), folder / "transformer_2")
    with pytest.raises(ValueError, match="boundary_ratio"):
        load_model("wan2.2-t2v", path=str(folder))


def test_latent_shapes_and_size_errors(models):
    assert models["flux2-klein"].latent_shape(24, 40, None) == (16, 6, 10)  # 2x2 patches of 12 x 20 x 4
    assert models["z-image"].latent_shape(24, 40, None) == (4, 12, 20)
    assert models["wan2.2-t2v"].latent_shape(16, 32, 5) == (16, 2, 2, 4)
    for card in ("flux2-klein", "z-image"):
        with pytest.raises(ValueError, match="multiples of 4"):
            models[card].latent_shape(24, 42, None)
        with pytest.raises(ValueError, match="frames"):
            models[card].latent_shape(24, 40, 5)


# ---- parity with the stock pipelines ---------------------------------------------------------------

@pytest.mark.parametrize("guidance", [1.0, 4.0])
@pytest.mark.parametrize("card", CARDS)
def test_engine_ode_equals_the_stock_pipeline(stock, models, card, guidance):
    """Non-square, 3 prompts with different negatives, mixed seeds; the pipeline starts from the engine's noise."""
    model = models[card]
    traj = Engine(model).generate(requests(card, STEPS, guidance))
    noise = draw_noise(SEEDS, model.latent_shape(SIZES[card]["height"], SIZES[card]["width"],
                                                 SIZES[card].get("frames")))
    expected = pipeline_latents(card, stock[card], noise, STEPS, guidance).float()
    got = engine_latents(card, model, traj)
    assert got.shape == expected.shape and got.shape[0] == 3
    assert (got - expected).abs().max() <= 1e-5
    assert expected.abs().max() > 1.0  # not a trivially small output
    assert torch.isfinite(traj.images).all() and 0.0 <= traj.images.min() and traj.images.max() <= 1.0


def test_guidance_changes_the_output(models):
    for card in CARDS:
        engine = Engine(models[card])
        plain = engine.generate(requests(card, 2, 1.0)).latents[:, -1]
        guided = engine.generate(requests(card, 2, 4.0)).latents[:, -1]
        assert (plain - guided).abs().max() > 1e-3, card


def test_flux2_klein_decode_and_schedule_are_the_pipelines(stock, models):
    """decode undoes the batch-norm statistics and the 2x2 patches as the pipeline's end does; the Euler
    schedule is the scheduler's sigmas for linspace(1, 1/T, T) shifted by the empirical mu."""
    from engine.families.flux2_klein import empirical_mu

    model, pipe = models["flux2-klein"], stock["flux2-klein"]
    latents = draw_noise((5, 6), (16, 6, 10))
    with torch.no_grad():
        images = model.decode(latents)
        bn_mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
        bn_std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        stock = pipe.vae.decode(pipe._unpatchify_latents(latents * bn_std + bn_mean), return_dict=False)[0]
        stock = pipe.image_processor.postprocess(stock, output_type="pt")
        skipped = pipe.vae.decode(pipe._unpatchify_latents(latents), return_dict=False)[0]  # no de-normalisation
    assert images.shape == (2, 3, 24, 40) and (images - stock).abs().max() <= 1e-6
    assert (images - (skipped / 2 + 0.5).clamp(0, 1)).abs().max() > 1e-2
    # mu by hand for 60 tokens and 4 steps: m_200 = 0.00016927·60 + 0.45666666 = 0.46682286,
    # m_10 = 8.73809524e-05·60 + 1.89833333 = 1.90357619; a = (m_200 - m_10)/190; mu = 4a + m_200 - 200a.
    assert empirical_mu(60, 4) == pytest.approx(0.46682286 + (0.46682286 - 1.90357619) / 190 * (4 - 200), abs=1e-7)
    pipe.scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=empirical_mu(60, 4))
    torch.testing.assert_close(model.schedule(4, (16, 6, 10)), pipe.scheduler.sigmas.float(), rtol=0, atol=1e-7)


def test_flux2_klein_distilled_folder_refuses_guidance(tmp_path):
    from tiny_models.families_2026 import build_tiny_flux2_klein

    model = load_model("flux2-klein", path=str(build_tiny_flux2_klein(tmp_path / "klein", is_distilled=True)))
    assert model.embedded_guidance  # no unconditional branch
    engine = Engine(model)
    traj = engine.generate(requests("flux2-klein", 2, 1.0))
    assert torch.isfinite(traj.latents).all() and traj.negative_prompt_embeds is None
    guided = requests("flux2-klein", 2, 4.0)
    with pytest.raises(ValueError, match="is_distilled.*guidance_scale=4.0"):
        engine.generate([dataclasses.replace(r, negative_prompt="") for r in guided])
    with pytest.raises(ValueError, match="'flux2-klein' is guidance-distilled .* leave negative_prompt empty"):
        engine.generate(guided)  # its negative prompts would be dropped as well


def test_z_image_guide_is_the_pipelines_cfg_with_the_scale_minus_one(models):
    """pos + s·(pos - neg), s = g - 1: with v_c = 2, v_u = 1 and g = 4, 2 + 3·1 = 5 (the standard
    v_u + g·(v_c - v_u) gives 1 + 4 = 5 too: the same CFG, written as the pipeline writes it)."""
    model = models["z-image"]
    v_c, v_u = torch.full((1, 4, 2, 2), 2.0), torch.ones(1, 4, 2, 2)
    assert torch.equal(model.guide(v_u, v_c, 4.0), torch.full((1, 4, 2, 2), 5.0))
    assert torch.equal(model.guide(v_u, v_c, 1.0), v_c)


def test_z_image_captions_keep_only_real_tokens(models):
    """Each prompt's embeddings are padded to a fixed length with a mask; the row alone equals the row in a
    batch (the engine caches prompts one by one), and the mask counts the pipeline's real tokens."""
    model = models["z-image"]
    with torch.no_grad():
        cond = model.encode_prompts(PROMPTS)
        alone = model.encode_prompts(PROMPTS[1:2])
        rows = model.pipe._encode_prompt(prompt=list(PROMPTS), device="cpu")
    assert cond.embeds.shape[1] == model.max_sequence_length and cond.mask.dtype == torch.bool
    assert cond.mask.sum(1).tolist() == [r.shape[0] for r in rows] and len({r.shape[0] for r in rows}) == 3
    n = rows[1].shape[0]
    assert (alone.embeds[0, :n] - cond.embeds[1, :n]).abs().max() <= 1e-5 and not cond.embeds[1, n:].any()


# ---- Wan2.2: the two experts ----------------------------------------------------------------------

def test_wan22_switches_experts_at_the_boundary(models):
    """Both experts matter: the ODE with every step on the high-noise expert (boundary 0) or on the low-noise
    one (boundary above 1000) differs from the switched run; rows at different times in one forward go to
    their own expert, as they would alone."""
    model = models["wan2.2-t2v"]
    experts = model.transformer
    assert experts.boundary_timestep == 875.0 and experts.high is model.pipe.transformer
    engine = Engine(model)
    switched = engine.generate(requests("wan2.2-t2v", STEPS, 1.0)).latents[:, -1]
    for boundary in (0.0, 1001.0):
        experts.boundary_timestep = boundary
        try:
            single = engine.generate(requests("wan2.2-t2v", STEPS, 1.0)).latents[:, -1]
        finally:
            experts.boundary_timestep = 875.0
        assert (single - switched).abs().max() > 1e-3
    cond = model.encode_prompts(PROMPTS[:2])
    x = torch.randn(2, 16, 2, 2, 4)
    t = torch.tensor([0.95, 0.3])  # one row per expert
    with torch.no_grad():
        both = model.velocity(experts, x, t, cond)
        row0 = model.velocity(experts, x[:1], t[:1], cond._replace(embeds=cond.embeds[:1], pooled=cond.pooled[:1]))
        row1 = model.velocity(experts, x[1:], t[1:], cond._replace(embeds=cond.embeds[1:], pooled=cond.pooled[1:]))
        high_only = model.velocity(experts.high, x, t, cond)
    assert (both - torch.cat([row0, row1])).abs().max() <= 1e-6
    assert (both[1] - high_only[1]).abs().max() > 1e-3  # the low-time row did not run the high-noise expert


def test_model_experts_is_refused_on_a_one_transformer_card(tmp_path):
    from flywheel.runs.config import ConfigError
    from trainers.grpo import main

    with pytest.raises(ConfigError, match="model.experts=low: card 'toy-digits' has one transformer"):
        main([f"run_dir={tmp_path / 'run'}", "model.experts=low", "tracker=none", "steps=1"])
    assert not (tmp_path / "run").exists()


# ---- LoRA runs ----------------------------------------------------------------------------------

def grpo_args(card, folder, run_dir, prompts, *extra):
    """A 3-step LoRA run; Wan2.2 rolls out 4 steps (flow times 1, .973, .923 on the high-noise expert, .8 on
    the low-noise one; 2 steps would stay above the boundary)."""
    size = SIZES[card]
    frames = [f"sampling.frames={size['frames']}"] if "frames" in size else []
    steps = STEPS if card == "wan2.2-t2v" else 2
    return [f"run_dir={run_dir}", f"model.card={card}", f"model.path={folder}", "tracker=none", "steps=3",
            f"data.prompts={prompts}", f"data.eval_prompts={prompts}", "data.prompts_per_step=2", "data.group_size=2",
            f"sampling.steps={steps}", "eval.seeds=1", "eval.steps=2", "eval.every=1000",
            "sample_every=1000", "reward.scorers=jpeg_compressibility:1.0", "model.finetune=lora", "model.lora_rank=4",
            "model.lora_alpha=8", f"sampling.height={size['height']}", f"sampling.width={size['width']}", *frames,
            *extra]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS[:2]) + "\n")
    return path


def load_stock_lora(card, pipe, lora_dir):
    """The run's lora/ folder into the stock pipeline as a user would load it (Wan2.2: one file per expert)."""
    if card == "wan2.2-t2v":
        pipe.load_lora_weights(str(lora_dir))
        pipe.load_lora_weights(str(lora_dir), weight_name="transformer_2_lora_weights.safetensors",
                               load_into_transformer_2=True)
    else:
        pipe.load_lora_weights(str(lora_dir))


@pytest.mark.slow
@pytest.mark.parametrize("card", CARDS)
def test_grpo_lora_run_and_the_saved_lora_reproduces_the_engine_in_the_stock_pipeline(folders, prompts_file,
                                                                                       tmp_path, card):
    from trainers.grpo import main

    guidance = 2.0 if card != "flux2-klein" else 1.0
    run_dir = tmp_path / "run"
    main(grpo_args(card, folders[card], run_dir, prompts_file, f"sampling.guidance_scale={guidance}",
                   f"eval.guidance_scale={guidance}", "train.kl_beta=0", "train.log_kl=false", "train.learning_rate=0.02"))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["ratio/max_dev"] < 1e-5  # training's forward recomputes the rollout's log-probs
    trained = load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))
    lora_b = {k: v for k, v in trained.items() if "lora_B" in k}
    assert lora_b and all("lora_" in k for k in trained) and max(v.abs().max() for v in lora_b.values()) > 0
    if card == "wan2.2-t2v":  # both experts trained by default, both moved
        for expert in ("high", "low"):
            assert max(v.abs().max() for k, v in lora_b.items() if k.startswith(expert + ".")) > 0

    model = load_model(card, path=str(folders[card]))
    add_lora(model.transformer, 4, 8, get_card(card).defaults["lora_targets"])
    assert not model.transformer.load_state_dict(trained, strict=False).unexpected_keys
    engine = Engine(model)
    tuned = engine.generate(requests(card, 3, guidance)).latents[:, -1]
    with adapters_disabled(model.transformer):
        base = engine.generate(requests(card, 3, guidance)).latents[:, -1]
    pipe = stock_pipeline(card, folders[card])
    noise = draw_noise(SEEDS, tuple(base.shape[1:]))
    stock_base = pipeline_latents(card, pipe, noise, 3, guidance).float()
    load_stock_lora(card, pipe, run_dir / "lora")
    stock_tuned = pipeline_latents(card, pipe, noise, 3, guidance).float()
    if card == "flux2-klein":
        tuned, base = model.to_vae_latents(tuned), model.to_vae_latents(base)
    assert (stock_base - base).abs().max() <= 1e-5
    assert (tuned - base).abs().max() > 1e-3  # the adapter matters...
    assert (stock_tuned - tuned).abs().max() <= 1e-5  # ...and the same way in the stock pipeline


@pytest.mark.slow
@pytest.mark.parametrize("card", CARDS)
def test_nft_lora_run_changes_the_adapter(folders, prompts_file, tmp_path, card):
    """DiffusionNFT, three LoRA steps; on Wan2.2 with model.experts=low only the low-noise expert trains (the
    high-noise one's adapter is neither saved nor exported)."""
    import math

    from trainers.nft import main

    extra = ["model.experts=low"] if card == "wan2.2-t2v" else []
    run_dir = tmp_path / "nft"
    main(grpo_args(card, folders[card], run_dir, prompts_file, *extra))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows[1:])
    trained = load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert lora_b and max(v.abs().max() for v in lora_b) > 0
    if card == "wan2.2-t2v":
        # The trained weights and NFT's sampling policy (saved as recipe/<name>): the low-noise expert's only.
        assert all(k.removeprefix("recipe/").split("/")[-1].startswith("low.") for k in trained)
        assert any(k.startswith("low.") for k in trained)
        assert sorted(p.name for p in (run_dir / "lora").glob("*.safetensors")) == [
            "transformer_2_lora_weights.safetensors"]


@pytest.mark.parametrize("overrides, frozen, said", [
    (["model.experts=low"], [0, 1], "model.experts=low: stochastic step(s) 0, 1 of sampling.sde_window=None run "
                                    "the frozen high-noise expert, which adds their noise with no gradient; set "
                                    "sampling.sde_window to [2, 4], its steps"),
    (["model.experts=high", "sampling.sde_window=[1,4]"], [2, 3], "model.experts=high: stochastic step(s) 2, 3 of "
                                                                  "sampling.sde_window=[1, 4] run the frozen "
                                                                  "low-noise expert"),
    (["model.experts=low", "sampling.sde_window=[2,4]"], [], None),  # the trained expert's steps only
    (["model.experts=high", "sampling.sde_window=[0,2]"], [], None),
    (["sampling.sde_window=[0,4]"], None, None),  # both experts train (the default)
])
def test_sde_steps_on_the_frozen_wan22_expert_are_warned_before_the_run(folders, prompts_file, tmp_path, capsys,
                                                                        overrides, frozen, said):
    """A 4-step SDE rollout on the tiny folder (the Euler flow times at shift 12, x 1000: 1000, 961, 861, 126):
    steps 0-1 run the high-noise expert, 2-3 the low-noise one (boundary 875). With one expert trained,
    an SDE step on the other adds noise and no gradient, which the docs said to avoid but nothing warned of."""
    from flywheel.recipe.policy import build_policy
    from flywheel.recipe.preflight import expert_steps
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    cfg = parse_config(Config, grpo_args("wan2.2-t2v", folders["wan2.2-t2v"], tmp_path / "run", prompts_file,
                                         *overrides))
    build_policy(cfg, torch.device("cpu"), reference=False)
    err = capsys.readouterr().err
    if said is None:
        assert "frozen" not in err, err
    else:
        assert f"warning: {said}" in err, err
    steps = expert_steps(load_model("wan2.2-t2v", path=str(folders["wan2.2-t2v"])), cfg.model.experts, cfg.sampling)
    assert (steps[0] if steps is not None else None) == frozen


def test_weight_sync_carries_both_experts(folders):
    """The trained tensors of both experts (`high.*`, `low.*`) load into another engine's copy by name, and it
    then generates what the trainer's model does."""
    trainer, served = (load_model("wan2.2-t2v", path=str(folders["wan2.2-t2v"])) for _ in range(2))
    for model in (trainer, served):
        add_lora(model.transformer, 4, 8, get_card("wan2.2-t2v").defaults["lora_targets"])
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    tensors = {n: p.detach() for n, p in trainer.transformer.named_parameters() if "lora_" in n}
    assert {n.split(".")[0] for n in tensors} == {"high", "low"}
    engine = Engine(served)
    before = engine.generate(requests("wan2.2-t2v", STEPS, 1.0)).latents[:, -1]
    assert engine.load_weights(tensors, version=1)["tensors"] == len(tensors)
    after = engine.generate(requests("wan2.2-t2v", STEPS, 1.0)).latents[:, -1]
    expected = Engine(trainer).generate(requests("wan2.2-t2v", STEPS, 1.0)).latents[:, -1]
    assert (after - expected).abs().max() <= 1e-6 and (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("experts, trained", [("high", {"high"}), ("low", {"low"}), (None, {"high", "low"})])
def test_model_experts_chooses_the_trained_weights(folders, tmp_path, experts, trained):
    """Full fine-tuning too: only the chosen experts' weights are trainable (the card's default: both)."""
    from flywheel.recipe.policy import build_policy
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    args = [f"run_dir={tmp_path / 'run'}", "model.card=wan2.2-t2v", f"model.path={folders['wan2.2-t2v']}",
            "model.finetune=full", "train.log_kl=false"]
    cfg = parse_config(Config, args + ([f"model.experts={experts}"] if experts else []))
    policy = build_policy(cfg, torch.device("cpu"), reference=False)
    assert {n.split(".")[0] for n, _ in policy.named_params} == trained
    frozen = [n for n, p in policy.transformer.named_parameters() if not p.requires_grad]
    assert all(n.split(".")[0] not in trained for n in frozen) and (bool(frozen) == (len(trained) == 1))


@pytest.mark.slow
def test_wan22_lora_trains_under_ddp_with_two_processes(folders, prompts_file, tmp_path):
    """Two ranks (DDP on CPU): a forward on one expert leaves the other's adapter unused, which DDP refuses
    ("parameters that were not used in producing loss") unless the idle expert gets its zero gradient."""
    import os

    run_dir = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29549",
           str(ROOT / "trainers" / "grpo.py"),
           *grpo_args("wan2.2-t2v", folders["wan2.2-t2v"], run_dir, prompts_file, "train.kl_beta=0", "train.log_kl=false")]
    cmd[cmd.index("steps=3")] = "steps=2"
    out = run_process_group(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    trained = load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))
    for expert in ("high", "low"):
        assert max(v.abs().max() for k, v in trained.items() if k.startswith(expert + ".") and "lora_B" in k) > 0
