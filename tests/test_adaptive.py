"""The content-adaptive denoise loop (engine/adaptive.py): parity, ragged batches, exact rollouts, metrics, errors."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from engine import Engine, GenerationRequest, PromptEmbeds, compare_outputs
from engine.adaptive import AdaptiveLoop, RowCache, check_adaptive_path, relative_change, select_embeds
from engine.denoise import concat_embeds, denoise
from engine.sampling import flow_timesteps, sde_t_cap, step_log_prob, step_noise_levels

WORDS = ["seven", "three", "one", "zero", "two", "nine"]
BATCH_TOLERANCE = 1e-5  # the engine's documented batch invariance on CPU (engine/engine.py)


def requests(n=4, **kw):
    return [GenerationRequest(prompt=f"a handwritten {w}", seed=300 + i, **kw) for i, w in enumerate(WORDS[:n])]


# ---- threshold 0 and no early exit is the plain loop, bit for bit -----------------------------------------------

def _loop_inputs(engine, steps, sampler, guidance, batch=3):
    cond = engine.encode_prompts([f"a handwritten {w}" for w in WORDS[:batch]])
    uncond = engine.encode_prompts([""] * batch) if guidance != 1.0 else None
    generator = torch.Generator().manual_seed(7)
    noise = torch.randn((batch, 1, 8, 8), generator=generator)
    step_noise = torch.randn((batch, steps, 1, 8, 8), generator=generator) if sampler != "ode" else None
    levels = step_noise_levels(steps, sampler, 0.7 if sampler == "sde" else 0.5)
    return (noise, step_noise, flow_timesteps(steps), levels, cond,
            None if uncond is None else concat_embeds(uncond, cond), guidance)


@pytest.mark.parametrize("sampler,guidance", [("ode", 1.0), ("ode", 3.0), ("sde", 1.0), ("cps", 2.0)])
def test_threshold_zero_without_early_exit_is_the_plain_loop_bit_for_bit(toy_engine, sampler, guidance):
    noise, step_noise, timesteps, levels, cond, uncond_cond, g = _loop_inputs(toy_engine, 6, sampler, guidance)
    model = toy_engine.model
    plain_latents, plain_log_probs = denoise(model, model.transformer, noise, step_noise, timesteps, levels, cond,
                                             uncond_cond, g, sampler=sampler)
    result = AdaptiveLoop([0.0] * 3, [None] * 3)(model, model.transformer, noise, step_noise, timesteps, levels,
                                                 cond, uncond_cond, g, sampler=sampler)
    report = compare_outputs({"latents": plain_latents, "log_probs": plain_log_probs},
                             {"latents": result.latents, "log_probs": result.log_probs})
    assert report["all"]["equal"], report
    assert result.computed.all() and result.steps_computed.tolist() == [6, 6, 6]


def test_engine_requests_with_threshold_zero_equal_default_requests_bit_for_bit(toy_engine):
    default = toy_engine.generate(requests(3, sampler="ode", guidance_scale=2.0))
    explicit = toy_engine.generate(requests(3, sampler="ode", guidance_scale=2.0, cache_threshold=0.0,
                                            early_exit=None))
    assert compare_outputs(default, explicit)["all"]["equal"]
    assert default.steps_computed.tolist() == [10, 10, 10]
    assert default.cache_hit_rate.tolist() == [0.0, 0.0, 0.0]


# ---- ragged batches ----------------------------------------------------------------------------------------------

def test_rows_that_exit_at_different_steps_equal_each_row_run_alone(toy_engine):
    # Guidance 2: the unconditional branch of each computed row must be picked out of the stacked conditioning.
    settings = [(0.0, None), (0.1, None), (0.3, None), (0.0, 0.05), (0.6, 0.2)]
    batch = [GenerationRequest(prompt=f"a handwritten {w}", seed=500 + i, sampler="ode", guidance_scale=2.0,
                               steps=12, cache_threshold=th, early_exit=ee)
             for i, (w, (th, ee)) in enumerate(zip(WORDS, settings))]
    together = toy_engine.generate(batch)
    computed = together.steps_computed.tolist()
    assert len(set(computed)) >= 3, computed  # the rows really are ragged
    assert computed[0] == 12 and min(computed) < 8
    for i, request in enumerate(batch):
        alone = toy_engine.generate([request])
        assert alone.steps_computed.tolist() == [computed[i]]
        report = compare_outputs(alone, together.select([i]))
        assert report["latents"]["max_abs_diff"] <= BATCH_TOLERANCE, (i, report["latents"])
        assert report["images"]["max_abs_diff"] <= BATCH_TOLERANCE


def test_keep_trajectory_false_keeps_only_the_same_final_latent(toy_engine):
    full = toy_engine.generate(requests(3, sampler="ode", cache_threshold=0.2))
    last = toy_engine.generate(requests(3, sampler="ode", cache_threshold=0.2, keep_trajectory=False))
    assert last.latents.shape[1] == 1 and torch.equal(last.latents[:, 0], full.latents[:, -1])
    assert torch.equal(last.steps_computed, full.steps_computed)


def test_requests_with_different_settings_share_a_batch():
    a, b = GenerationRequest("x", 1, cache_threshold=0.2, sampler="ode"), GenerationRequest("y", 2, sampler="ode",
                                                                                             early_exit=0.1)
    assert a.batch_key() == b.batch_key() == GenerationRequest("z", 3, sampler="ode").batch_key()


# ---- rollouts: the trained steps are the plain loop's -----------------------------------------------------------

@pytest.mark.parametrize("sampler", ["sde", "cps"])
def test_rollouts_skip_only_after_the_window_and_keep_the_trained_log_probs_exact(toy_engine, sampler):
    kw = dict(sampler=sampler, noise_level=0.7 if sampler == "sde" else 0.5, sde_window=(2, 5), steps=12)
    plain = toy_engine.generate(requests(4, **kw))
    cached = toy_engine.generate(requests(4, cache_threshold=0.5, **kw))
    assert (cached.steps_computed < 12).all()  # the tail after the window was skipped ...
    assert torch.equal(cached.log_probs, plain.log_probs)  # ... and every trained step is the plain loop's
    assert torch.equal(cached.latents[:, :6], plain.latents[:, :6])  # states up to the window's end too
    assert not torch.equal(cached.latents[:, -1], plain.latents[:, -1])
    # On-policy: the recorded log-probs of the window recompute exactly from the stored states.
    model, timesteps = toy_engine.model, cached.timesteps
    for k in range(2, 5):
        x, x_next = cached.latents[:, k], cached.latents[:, k + 1]
        v = model.velocity(model.transformer, x, timesteps[k], PromptEmbeds(cached.prompt_embeds,
                                                                               cached.pooled_prompt_embeds,
                                                                               cached.prompt_mask))
        recomputed, _, _ = step_log_prob(sampler, x, x_next, v, timesteps[k], timesteps[k + 1],
                                         cached.levels_at(k), sde_t_cap(timesteps))
        assert torch.equal(recomputed, cached.log_probs[:, k])


def test_the_loop_refuses_to_skip_a_stochastic_step(toy_engine):
    noise, step_noise, timesteps, _, cond, _, _ = _loop_inputs(toy_engine, 6, "sde", 1.0)
    levels = step_noise_levels(6, "sde", 0.7, (1, 3))
    loop = AdaptiveLoop([0.5] * 3, [None] * 3)
    with pytest.raises(ValueError, match=r"stochastic step 2 .*valid: skip_from >= 3"):
        loop(toy_engine.model, toy_engine.model.transformer, noise, step_noise, timesteps, levels, cond, None, 1.0,
             skip_from=2)
    result = loop(toy_engine.model, toy_engine.model.transformer, noise, step_noise, timesteps, levels, cond, None,
                  1.0)  # the default starts after the window: steps 0..2 are always computed
    assert result.computed[:, :3].all() and not result.computed[:, 3:].all()


# ---- metrics computed by hand -------------------------------------------------------------------------------------

class LinearVelocityModel:
    """A FlowModel whose velocity ignores x: v = 1 + s·(1 - t) everywhere, s the row's first embedding value.

    Every call records which rows (by s) it saw, so the skip pattern can be read back.
    """

    def __init__(self):
        self.calls: list[list[float]] = []

    def velocity(self, transformer, x, t, cond):
        slopes = cond.embeds[:, 0, 0]
        self.calls.append(slopes.tolist())
        return (1 + slopes * (1 - t)).view(-1, 1, 1) * torch.ones_like(x)


def _hand_run(thresholds, exits, slopes=(0.4, 0.4, 0.4), orders=None):
    model = LinearVelocityModel()
    batch = len(slopes)
    cond = PromptEmbeds(torch.tensor(slopes, dtype=torch.float32).view(batch, 1, 1), torch.zeros(batch, 1), None)
    timesteps = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    result = AdaptiveLoop(thresholds, exits, orders)(model, nn.Identity(), torch.zeros(batch, 1, 2), None, timesteps,
                                                     [0.0] * 4, cond, None, 1.0, sampler="ode")
    return result, model.calls


@pytest.mark.parametrize("order", [0, 1])
def test_skip_decisions_and_metrics_match_a_hand_computation(order):
    # v(t) = 1 + 0.4(1 - t): 1, 1.1, 1.2, 1.3 at t = 1, .75, .5, .25.
    # Calls at steps 0, 1: d = |1.1 - 1| / 1.1 = 0.0909, rate = d / 0.25 = 0.3636.
    # Step 2: estimate 0.3636 · 0.25 = 0.0909; step 3 (if 2 was skipped): 0.3636 · 0.5 = 0.1818.
    # threshold 0.05: no skip; 0.1: skip step 2, call at 3; 0.2: skip steps 2 and 3.
    result, calls = _hand_run([0.05, 0.1, 0.2], [None] * 3, slopes=(0.4, 0.41, 0.42), orders=[order] * 3)
    # The slopes differ slightly to tell rows apart in the call log; their rates differ by < 3%, which moves
    # no decision (the margins are > 9%).
    assert result.computed.tolist() == [[True] * 4, [True, True, False, True], [True, True, False, False]]
    assert result.steps_computed.tolist() == [4, 3, 2]
    assert [len(c) for c in calls] == [3, 3, 1, 2]  # whole batch, whole batch, row 0 alone, rows 0 and 1
    assert calls[2] == pytest.approx([0.4]) and calls[3] == pytest.approx([0.4, 0.41])
    if order == 0:
        # Euler with the last call's velocity on skipped steps, dt = -0.25 every step:
        # row 0: 1 + 1.1 + 1.2 + 1.3 (slope 0.4) = 4.6; row 1 (slope 0.41): 1 + 1.1025 + 1.1025 + 1.3075 = 4.5125;
        # row 2 (slope 0.42): 1 + 1.105 · 3 = 4.315.
        sums = [4.6, 4.5125, 4.315]
    else:
        # The line through the last two calls is exact for a velocity linear in t: every row takes the velocities
        # of a call at every step: 1 + (1 + s/4) + (1 + s/2) + (1 + 3s/4) = 4 + 1.5s.
        sums = [4 + 1.5 * 0.4, 4 + 1.5 * 0.41, 4 + 1.5 * 0.42]
    torch.testing.assert_close(result.latents[:, -1, 0, 0], -0.25 * torch.tensor(sums), atol=1e-6, rtol=0)


def test_extrapolation_follows_each_rows_last_two_calls_across_sub_batches():
    # 5 steps, t = 1, .8, .6, .4, .2, v = 1 + 0.5(1 - t) = 1, 1.1, 1.2, 1.3, 1.4 for both rows.
    # Both call at steps 0 and 1: rate = (0.1 / 1.1) / 0.2 = 0.4545; step 2 estimate 0.0909, step 3 0.1818.
    # Row 0 (threshold 0.1) skips step 2, calls alone at step 3 (rate (0.2 / 1.3) / 0.4 = 0.3846), then skips
    # step 4 (estimate 0.0769) on the line through its calls at t = .8 and .4: 1.3 + 0.5·(1.3 - 1.1) = 1.4.
    # Row 1 (threshold 0.5) skips steps 2-4 on the line through t = 1 and .8: exact too.
    model = LinearVelocityModel()
    cond = PromptEmbeds(torch.full((2, 1, 1), 0.5), torch.zeros(2, 1), None)
    timesteps = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    result = AdaptiveLoop([0.1, 0.5], [None, None])(model, nn.Identity(), torch.zeros(2, 1, 2), None, timesteps,
                                                    [0.0] * 5, cond, None, 1.0, sampler="ode")
    assert result.computed.tolist() == [[True, True, False, True, False], [True, True, False, False, False]]
    assert [len(c) for c in model.calls] == [2, 2, 1]
    # Every step took the exact velocity: x = -0.2 · (1 + 1.1 + 1.2 + 1.3 + 1.4) = -1.2.
    torch.testing.assert_close(result.latents[:, -1, 0, 0], torch.tensor([-1.2, -1.2]), atol=1e-6, rtol=0)


def test_early_exit_matches_a_hand_computation():
    # x starts at 0, dt = -0.25. Step 0: v = 1, prediction x - t·v = -1, x -> -0.25.
    # Step 1 (t = .75): v = 1.1, prediction -0.25 - 0.825 = -1.075, change 0.075 / 1.075 = 0.06977,
    #   per unit time / 0.25 = 0.2791, still to come x 0.75 = 0.2093.
    # Step 2 (t = .5): x = -0.525, v = 1.2, prediction -1.125, change 0.05 / 1.125 = 0.04444, / 0.25 x 0.5 = 0.0889.
    # Step 3 (t = .25): x = -0.825, v = 1.3, prediction -1.15 (no step left to skip).
    # early_exit 0.25: exits after step 1 (2 calls) and lands on its prediction -1.075;
    # 0.1: exits after step 2 (3 calls), lands on -1.125; 0.08: never exits (4 calls), -1.15.
    result, _ = _hand_run([0.0] * 3, [0.25, 0.1, 0.08])
    assert result.steps_computed.tolist() == [2, 3, 4]
    torch.testing.assert_close(result.latents[:, -1, 0, 0], torch.tensor([-1.075, -1.125, -1.15]),
                               atol=1e-6, rtol=0)


def test_row_cache_accumulates_the_estimated_change_until_a_call():
    row = RowCache()
    assert not row.should_skip(0.9, 1.0)  # never called: no estimate
    row.record_call(1.0, None, None, None)
    assert not row.should_skip(0.9, 1.0)  # one call: no rate yet
    row.record_call(0.8, 0.1, 0.5, None)  # rate 0.1 / 0.2 = 0.5 per unit t
    assert row.estimated_change(0.7) == pytest.approx(0.05) and row.should_skip(0.7, 0.06)
    assert row.estimated_change(0.6) == pytest.approx(0.10) and not row.should_skip(0.6, 0.06)
    assert not row.should_skip(0.7, 0.0)  # threshold 0 never skips
    # Extrapolation weight at t = 0.7 from calls at 1.0 and 0.8: (0.8 - 0.7) / (1.0 - 0.8) = 0.5; 0 at order 0.
    assert row.extrapolation(0.7, 1) == pytest.approx(0.5) and row.extrapolation(0.7, 0) == 0.0
    row.exited = True
    assert row.extrapolation(0.7, 1) == 0.0  # an exited row keeps its last velocity: it lands on its prediction


def test_relative_change_and_select_embeds():
    new, old = torch.tensor([[2.0, -2.0], [1.0, 1.0]]), torch.tensor([[1.0, -2.0], [1.0, 1.0]])
    assert relative_change(new, old).tolist() == [0.25, 0.0]
    assert relative_change(torch.zeros(1, 3), torch.zeros(1, 3)).tolist() == [0.0]
    embeds = PromptEmbeds(torch.arange(6.0).view(3, 2, 1), torch.arange(3.0).view(3, 1),
                          torch.tensor([[True, False], [True, True], [False, False]]),
                          {"image": torch.arange(3.0).view(3, 1)})
    picked = select_embeds(embeds, torch.tensor([2, 0]))
    assert picked.embeds.flatten().tolist() == [4.0, 5.0, 0.0, 1.0] and picked.pooled.flatten().tolist() == [2, 0]
    assert picked.mask.tolist() == [[False, False], [True, False]] and picked.extra["image"].flatten().tolist() == [2, 0]


def test_engine_stats_count_the_model_calls(toy_model):
    engine = Engine(toy_model)
    plain = engine.generate(requests(2, sampler="ode", steps=8))
    cached = engine.generate(requests(2, sampler="ode", steps=8, cache_threshold=0.3))
    calls = 16 + int(cached.steps_computed.sum())
    assert plain.steps_computed.tolist() == [8, 8] and calls < 32
    assert engine.stats() == {"engine/steps": 32, "engine/steps_computed": calls,
                              "engine/cache_hit_rate": pytest.approx(1 - calls / 32)}
    torch.testing.assert_close(cached.cache_hit_rate, 1 - cached.steps_computed.float() / 8)
    joined = type(cached).concat([plain, cached])
    assert joined.steps_computed.tolist() == [8, 8] + cached.steps_computed.tolist()


# ---- bad settings -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,error,match", [
    (dict(cache_threshold=-0.1), ValueError, r"cache_threshold=-0.1 is out of range; valid: 0 <= cache_threshold <= 1"),
    (dict(cache_threshold=2.0), ValueError, r"valid: 0 <= cache_threshold <= 1"),
    (dict(cache_threshold=float("nan")), ValueError, r"cache_threshold"),
    (dict(cache_threshold="0.1"), TypeError, r"cache_threshold must be a number"),
    (dict(cache_order=2), ValueError, r"cache_order=2 is out of range; valid: 0 <= cache_order <= 1"),
    (dict(cache_order=0), ValueError, r"cache_order=0 applies to the steps cache_threshold skips"),
    (dict(cache_order=0, early_exit=0.1), ValueError, r"cache_threshold=0 skips none"),
    (dict(early_exit=0.0), ValueError, r"early_exit=0 can never be met; valid: 0 < early_exit <= 1"),
    (dict(early_exit=5.0), ValueError, r"early_exit"),
    (dict(sampler="sde", cache_threshold=0.1), ValueError, r"sde_window=None with steps=10 leaves none"),
    (dict(sampler="cps", noise_level=0.5, sde_window=(2, 10), early_exit=0.1), ValueError, r"valid: sampler='ode'"),
])
def test_bad_request_settings_are_clear_errors(kw, error, match):
    with pytest.raises(error, match=match):
        GenerationRequest("a handwritten one", 0, **kw)


def test_bad_loop_settings_and_paths_are_clear_errors(toy_engine):
    with pytest.raises(ValueError, match="one cache threshold, early-exit setting and cache order per row"):
        AdaptiveLoop([0.1, 0.1], [None])
    with pytest.raises(ValueError, match=r"cache_orders\[0\]=2; valid: 0 .* or 1"):
        AdaptiveLoop([0.1], [None], [2])
    with pytest.raises(ValueError, match=r"cache_thresholds\[1\]=-1.*>= 0"):
        AdaptiveLoop([0.1, -1], [None, None])
    with pytest.raises(ValueError, match=r"early_exits\[0\]=0.*> 0"):
        AdaptiveLoop([0.1], [0])
    noise, step_noise, timesteps, levels, cond, _, _ = _loop_inputs(toy_engine, 4, "ode", 1.0)
    with pytest.raises(ValueError, match="settings for 2 rows but the batch has 3"):
        AdaptiveLoop([0.1] * 2, [None] * 2)(toy_engine.model, toy_engine.model.transformer, noise, None, timesteps,
                                            levels, cond, None, 1.0)
    with pytest.raises(ValueError, match="folder's own scheduler"):
        check_adaptive_path("wan2.1-t2v", "ode", True, False, False)
    with pytest.raises(ValueError, match="valid there: sampler='ode'"):
        check_adaptive_path("ltx2", "sde", False, False, True)
    toy_engine.flash_compress = 0.5
    with pytest.raises(ValueError, match="MixGRPO-Flash"):
        toy_engine.generate(requests(2, sampler="sde", sde_window=(0, 3), cache_threshold=0.1))


# ---- a real family ------------------------------------------------------------------------------------------------

def test_tiny_sd3_ragged_rows_equal_each_row_alone_with_cfg(tmp_path):
    from tiny_models.core import build_tiny_sd3

    engine = Engine.from_card("sd3", path=str(build_tiny_sd3(tmp_path / "sd3")))
    batch = [GenerationRequest(prompt=p, seed=i, card="sd3", sampler="ode", guidance_scale=3.0, height=32, width=32,
                               steps=8, cache_threshold=th)
             for i, (p, th) in enumerate([("a red cat", 0.0), ("a blue dog", 0.1), ("a red cat", 0.3)])]
    together = engine.generate(batch)
    computed = together.steps_computed.tolist()
    assert computed[0] == 8 and computed[2] < computed[1] < 8, computed
    plain = engine.generate([replace(r, cache_threshold=0.0) for r in batch])
    assert not torch.equal(together.latents[1:, -1], plain.latents[1:, -1])  # the skips changed rows 1 and 2
    for i, request in enumerate(batch):
        alone = engine.generate([request])
        assert alone.steps_computed.tolist() == [computed[i]]
        assert compare_outputs(alone, together.select([i]))["latents"]["max_abs_diff"] <= BATCH_TOLERANCE
