"""Workflows as servables: ids in the cards' namespace, requires/validate, cycles, the runner, SDEdit refinement."""

import asyncio
import base64
import io
from dataclasses import replace

import numpy as np
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from engine import AsyncEngine, Engine, GenerationRequest, UnknownCardError
from engine.serve import build_app
from engine.workflows import (FirstFrame, FromImage, FromText, MissingCardsError, Stage, Workflow, WorkflowCycleError,
                              WorkflowError, WorkflowRegistry, WorkflowRunner, default_registry)

PROMPTS = ["a photo of the digit 3", "a photo of the digit 7"]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_card("toy-digits")


def requests(workflow="toy.digits_then_refine", sampler="ode", seeds=(1, 2), **kwargs):
    return [GenerationRequest(prompt=p, seed=s, card=workflow, sampler=sampler, **kwargs)
            for p, s in zip(PROMPTS, seeds)]


def builder(workflow_id, *targets):
    """A builder of a workflow whose stages run `targets` in order (text first, then image-to-image on a card;
    a nested workflow, dotted, takes no input)."""
    stages = tuple(Stage(f"s{i}", t, FromImage(0.5) if i and "." not in t else FromText())
                   for i, t in enumerate(targets))
    return lambda: Workflow(workflow_id, "test", stages)


# ---- registry: ids, requires, validate, cycles -------------------------------------------------------


def test_catalog_workflows_are_addressable_by_id_with_their_required_cards():
    registry = default_registry()
    assert {"toy.digits_then_refine", "toy.refine_twice", "image_video.t2i_i2v"} <= set(registry.ids())
    assert registry.get("toy.digits_then_refine").requires == ("toy-digits",)
    assert registry.get("toy.refine_twice").requires == ("toy-digits",)  # through the nested workflow
    assert registry.get("image_video.t2i_i2v").requires == ("sd3", "wan2.1-i2v")
    described = registry.get("toy.refine_twice").describe()
    assert described["kind"] == "workflow" and [s["target"] for s in described["stages"]] == [
        "toy.digits_then_refine", "toy-digits"]
    with pytest.raises(KeyError, match="unknown workflow 'toy.nope'.*toy.digits_then_refine"):
        registry.get("toy.nope")


def test_validate_fails_fast_naming_every_missing_card():
    workflow = default_registry().get("image_video.t2i_i2v")
    workflow.validate(["sd3", "wan2.1-i2v", "toy-digits"])
    with pytest.raises(MissingCardsError, match=r"needs card\(s\) wan2\.1-i2v .*available: sd3") as err:
        workflow.validate(["sd3"])
    assert err.value.missing == ["wan2.1-i2v"]
    with pytest.raises(MissingCardsError) as err:
        WorkflowRunner({}).run("image_video.t2i_i2v", requests("image_video.t2i_i2v"))  # before any stage runs
    assert err.value.missing == ["sd3", "wan2.1-i2v"]


def test_a_workflow_id_that_is_a_card_id_or_not_dotted_and_unknown_targets_are_refused():
    registry = WorkflowRegistry(cards=lambda: ["toy-digits", "a.card"])
    with pytest.raises(WorkflowError, match="'a.card' is a card id"):
        registry.register("a.card", builder("a.card", "toy-digits"))
    with pytest.raises(WorkflowError, match="must be dotted"):
        registry.register("nodot", builder("nodot", "toy-digits"))
    with pytest.raises(WorkflowError, match="targets 'sd9', which is neither a card nor a registered workflow"):
        registry.register("t.x", builder("t.x", "toy-digits", "sd9"))
    with pytest.raises(WorkflowError, match="must return a Workflow with that id"):
        registry.register("t.y", builder("t.other", "toy-digits"))
    registry.register("t.ok", builder("t.ok", "toy-digits"))
    with pytest.raises(WorkflowError, match="already registered"):
        registry.register("t.ok", builder("t.ok", "toy-digits"))


def test_registering_a_card_under_a_catalog_workflow_id_is_refused():
    from engine.cards import ModelCard, list_cards, register_card

    with pytest.raises(ValueError, match="'toy.digits_then_refine' is a workflow id"):
        register_card(ModelCard(id="toy.digits_then_refine", description="a clash", load=lambda **_: None))
    assert "toy.digits_then_refine" not in list_cards()


def test_a_card_registered_later_under_a_workflow_id_is_caught_before_a_run():
    cards = ["toy-digits"]
    registry = WorkflowRegistry(cards=lambda: list(cards))
    registry.register("t.w", builder("t.w", "toy-digits"))
    cards.append("t.w")  # engine.cards accepted it: the registry refuses to run with the clash
    with pytest.raises(WorkflowError, match="t.w name both a card and a workflow"):
        WorkflowRunner({}, registry=registry).run("t.w", requests("t.w"))


def test_cycles_are_refused_at_registration_directly_and_through_nesting():
    registry = WorkflowRegistry(cards=lambda: ["toy-digits"])
    with pytest.raises(WorkflowCycleError, match="stage 's1' runs the workflow itself"):
        registry.register("t.self", builder("t.self", "toy-digits", "t.self"))
    registry.register("t.b", builder("t.b", "toy-digits"))
    registry.register("t.a", builder("t.a", "t.b", "toy-digits"))
    registry.register("t.c", builder("t.c", "t.a"))
    # Re-pointing t.b at t.c closes t.b -> t.c -> t.a -> t.b: refused, and t.b keeps its old builder.
    with pytest.raises(WorkflowCycleError, match="t.b -> t.c -> t.a -> t.b"):
        registry.register("t.b", builder("t.b", "toy-digits", "t.c"), replace=True)
    assert registry.get("t.b").requires == ("toy-digits",)


@pytest.mark.parametrize("stages, message", [
    ((Stage("s0", "toy-digits", FromImage(0.5)),), r"stage 's0' runs first.*must be FromText\(\)"),
    ((Stage("s0", "toy-digits", "text"),), r"has input 'text'; valid: FromText\(\), FromImage"),
    ((Stage("s0", "toy-digits", FromText(), {"stpes": 4}),), r"unknown request field 'stpes'; valid: .*steps"),
    ((Stage("s0", "toy-digits", FromText(), {"card": "sd3"}),), r"overrides 'card', which the runner sets"),
    ((Stage("s0", "toy-digits", FromText(), {"sampler": "sdx"}),), r"overrides that no request takes: .*sdx"),
    ((Stage("s0", "toy-digits"), Stage("s1", "toy-digits", FirstFrame())), r"'toy-digits' takes no first frame"),
    ((Stage("s0", "wan2.1-i2v"),), r"'wan2.1-i2v' needs a conditioning image.*FirstFrame\(\)"),
    ((Stage("s0", "toy-digits"), Stage("a.b", "toy-digits", FromImage(0.5))), r"stage name 'a.b' must be"),
    ((Stage("", "toy-digits"),), r"stage name '' must be"),
    ((Stage("s0", "t.inner", FromText(), {"steps": 4}),), r"runs workflow 't.inner', which takes no input"),
    ((Stage("s0", "toy-digits"), Stage("s1", "t.inner", FromImage(0.5))), r"runs workflow 't.inner'"),
])
def test_a_stage_that_cannot_run_as_defined_is_refused_at_registration_naming_it(stages, message):
    """Each of these used to register and then fail at run time (a TypeError from replace(), a card's refusal)
    or, for a dotted name, silently lose a stage's intermediate under a nested stage's path."""
    registry = WorkflowRegistry(cards=lambda: ["toy-digits", "wan2.1-i2v"])
    registry.register("t.inner", builder("t.inner", "toy-digits"))
    with pytest.raises(WorkflowError, match=message):
        registry.register("t.bad", lambda: Workflow("t.bad", "test", stages))
    assert "t.bad" not in registry.ids()
    # The same stages with the fault taken out register: the checks refuse the fault, not the shape.
    registry.register("t.good", lambda: Workflow("t.good", "test", (
        Stage("s0", "toy-digits", FromText(), {"steps": 4, "sampler": "ode", "noise_level": None}),
        Stage("s1", "t.inner"), Stage("s2", "wan2.1-i2v", FirstFrame()))))


def test_a_workflow_that_runs_itself_at_run_time_is_caught(engine):
    """Two ways past the registration check: a builder that changes after registration (builders are called at
    every look-up), and an engine that runs the workflow from inside one of its stages."""
    registry = WorkflowRegistry(cards=lambda: ["toy-digits"])
    registry.register("t.inner", builder("t.inner", "toy-digits"))
    registry.register("t.outer", builder("t.outer", "t.inner", "toy-digits"))
    runner = WorkflowRunner({"toy-digits": engine}, registry=registry)
    registry._builders["t.inner"] = builder("t.inner", "toy-digits", "t.outer")  # what a changing builder does
    with pytest.raises(WorkflowCycleError, match="reaches itself: t.outer -> t.inner -> t.outer"):
        runner.run("t.outer", requests("t.outer", steps=4))
    registry._builders["t.inner"] = builder("t.inner", "toy-digits")

    class Reentrant:  # a stage engine that (wrongly) serves its card through the workflow itself
        card_id, weight_version, model, device = "toy-digits", 0, engine.model, engine.device

        def generate(self, stage_requests, **kwargs):
            return runner.run("t.outer", stage_requests).trajectory

    runner.engines["toy-digits"] = Reentrant()
    with pytest.raises(WorkflowCycleError, match="re-entered itself at run time: t.outer -> t.inner -> t.outer"):
        runner.run("t.outer", requests("t.outer", steps=4))


# ---- the engine side of a refine stage (SDEdit) -------------------------------------------------------


def test_start_step_noises_the_given_latent_with_the_seed_and_runs_the_last_steps(engine):
    model = engine.model
    clean = torch.rand(2, 1, 8, 8) * 2 - 1
    reqs = [replace(r, card="toy-digits", start_step=6) for r in requests(steps=10)]
    traj = engine.generate(reqs, init_latents=clean)
    # Linear schedule of 10 steps: t_6 = 0.4; x_{t_6} = 0.6·x0 + 0.4·eps with eps the seed's first draw.
    eps = torch.stack([torch.randn((1, 8, 8), generator=torch.Generator().manual_seed(s)) for s in (1, 2)])
    assert torch.allclose(traj.latents[:, 0], 0.6 * clean + 0.4 * eps, atol=1e-6)
    assert traj.num_steps == 4 and torch.allclose(traj.timesteps, torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0]))
    # Four Euler steps x <- x + (t' - t)·v from there, written out by hand.
    cond = engine.encode_prompts(PROMPTS)
    x = 0.6 * clean + 0.4 * eps
    with torch.no_grad():
        for t, t_next in [(0.4, 0.3), (0.3, 0.2), (0.2, 0.1), (0.1, 0.0)]:
            x = x + (t_next - t) * model.velocity(model.transformer, x, torch.tensor(t), cond)
    assert torch.allclose(traj.latents[:, -1], x, atol=1e-5)
    assert torch.allclose(traj.images, ((x + 1) / 2).clamp(0, 1), atol=1e-5)


def test_start_step_and_init_latents_come_together_with_the_right_shape(engine):
    plain = [replace(r, card="toy-digits") for r in requests(steps=4)]
    with pytest.raises(ValueError, match="start_step=2 starts from an image"):
        engine.generate([replace(r, start_step=2) for r in plain])
    with pytest.raises(ValueError, match="start_step=0 starts from pure noise"):
        engine.generate(plain, init_latents=torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"init_latents must be \[B, \*latent\] = \[2, 1, 8, 8\]"):
        engine.generate([replace(r, start_step=2) for r in plain], init_latents=torch.zeros(2, 8, 8))
    with pytest.raises(ValueError, match="start_step=4 is out of range"):
        GenerationRequest("x", seed=0, steps=4, start_step=4)
    assert plain[0].batch_key() != replace(plain[0], start_step=1).batch_key()


# ---- the runner: toy workflows, intermediates, versions ---------------------------------------------


def test_toy_refine_runs_draw_then_sdedit_from_the_drawn_image(engine):
    runner = WorkflowRunner({"toy-digits": engine})
    out = runner.run("toy.digits_then_refine", requests(steps=10))
    assert out.stages == {}  # final only by default
    assert out.weight_versions == {"toy-digits": engine.weight_version}
    full = runner.run("toy.digits_then_refine", requests(steps=10), intermediates=True)
    assert list(full.stages) == ["draw", "refine"]
    assert torch.equal(full.images, out.images) and torch.equal(full.stages["refine"].images, out.images)
    draw, refine = full.stages["draw"].trajectory, full.stages["refine"].trajectory
    # The same as running the two stages by hand: the draw, then strength 0.3 (start at step 7) from its image.
    by_hand = engine.generate([replace(r, card="toy-digits") for r in requests(steps=10)])
    assert torch.equal(draw.images, by_hand.images)
    again = engine.generate([replace(r, card="toy-digits", start_step=7) for r in requests(steps=10)],
                            init_latents=by_hand.images * 2 - 1)
    assert torch.equal(refine.images, again.images) and refine.num_steps == 3
    assert not torch.equal(refine.images, draw.images)


def test_nested_workflow_returns_every_stage_by_dotted_path_and_stamps_each_engines_version(engine):
    frozen = Engine(engine.model, weight_version=7)
    runner = WorkflowRunner({"toy-digits": engine}, stage_engines={"again": frozen})
    out = runner.run("toy.refine_twice", requests("toy.refine_twice", steps=10), intermediates=True)
    assert list(out.stages) == ["first.draw", "first.refine", "again"]
    assert out.stages["again"].trajectory.num_steps == 2  # strength 0.2 of 10 steps
    assert out.weight_versions == {"toy-digits": engine.weight_version, "toy-digits@again": 7}
    assert torch.equal(out.images, out.stages["again"].images)


def test_a_refinement_stage_at_one_step_names_the_stage_and_the_steps_it_needs(engine):
    with pytest.raises(WorkflowError, match=r"image-to-image stage \(FromImage\(strength=.*needs steps >= 2.*steps=1"):
        WorkflowRunner({"toy-digits": engine}).run("toy.digits_then_refine", requests(steps=1))


def test_a_weight_load_between_two_stages_on_one_engine_keeps_both_versions_on_record():
    """Before: the later stage overwrote the card's entry, so the output claimed one version for both."""
    engine = Engine.from_card("toy-digits")
    generate = engine.generate

    def then_load(rows, init_latents=None):
        trajectory = generate(rows, init_latents)
        if engine.weight_version == 0:  # the push lands after 'draw', before 'refine'
            engine.load_weights({k: v * 1.01 for k, v in engine.model.transformer.state_dict().items()
                                 if k.endswith("proj_out.weight")}, version=7)
        return trajectory

    engine.generate = then_load
    out = WorkflowRunner({"toy-digits": engine}).run("toy.digits_then_refine", requests(steps=10),
                                                     intermediates=True)
    assert {p: s.weight_version for p, s in out.stages.items()} == {"draw": 0, "refine": 7}
    assert out.weight_versions == {"toy-digits": 0, "toy-digits@refine": 7}


# ---- routing: AsyncEngine and HTTP -----------------------------------------------------------------------


def test_async_engine_refuses_a_workflow_whose_cards_are_not_hosted_and_routes_one_that_is(engine):
    with pytest.raises(MissingCardsError, match=r"sd3, wan2\.1-i2v"):
        AsyncEngine(engine, workflows=["image_video.t2i_i2v"])
    served = AsyncEngine(engine, workflows=["toy.refine_twice"])
    listed = {m["id"]: m for m in served.models()}
    assert listed["toy.refine_twice"]["kind"] == "workflow"
    assert listed["toy.refine_twice"]["requires"] == ["toy-digits"]
    assert listed["toy.refine_twice"]["weight_versions"] == {"toy-digits": engine.weight_version}

    async def main():
        try:
            out = await served.submit(requests("toy.refine_twice", steps=10)[0])
            with pytest.raises(UnknownCardError, match="unknown generator card 'toy.nope'; known: toy-digits; "
                                                       "workflows: toy.refine_twice"):
                await served.submit(requests("toy.nope")[0])
            return out
        finally:
            await served.aclose()

    out = asyncio.run(main())
    direct = WorkflowRunner({"toy-digits": engine}).run("toy.refine_twice", requests("toy.refine_twice", steps=10)[:1])
    assert torch.equal(out.images, direct.images)


def test_http_lists_and_serves_a_workflow_with_intermediates_and_names_both_kinds_for_an_unknown_id(engine):
    async def main():
        served = AsyncEngine(engine, workflows=["toy.digits_then_refine"], max_wait_ms=1)
        server = TestServer(build_app(served), host="127.0.0.1", port=0)
        async with TestClient(server) as client:
            listed = await (await client.get("/v1/models")).json()
            weights = await (await client.get("/v1/weights")).json()
            body = {"prompt": PROMPTS[0], "seed": 5, "n": 2, "card": "toy.digits_then_refine", "sampler": "ode",
                    "return_intermediates": True}
            ok = await client.post("/v1/generate", json=body)
            unknown = await client.post("/v1/generate", json={**body, "card": "toy.nope"})
            latents = await client.post("/v1/generate", json={**body, "return_latents": True})
            return listed, weights, ok.status, await ok.json(), unknown.status, await unknown.json(), latents.status

    listed, weights, status, out, unknown_status, unknown, latents_status = asyncio.run(main())
    kinds = {m["id"]: m["kind"] for m in listed["models"]}
    assert kinds == {"toy-digits": "generator", "toy.digits_then_refine": "workflow"}
    workflow = next(m for m in listed["models"] if m["id"] == "toy.digits_then_refine")
    assert workflow["requires"] == ["toy-digits"] and [s["name"] for s in workflow["stages"]] == ["draw", "refine"]
    assert weights == {"weights": {"toy-digits": 0}}
    assert status == 200 and out["workflow"] == "toy.digits_then_refine" and out["seeds"] == [5, 6]
    assert out["weight_versions"] == {"toy-digits": 0} and set(out["intermediates"]) == {"draw", "refine"}
    assert out["intermediates"]["refine"] == out["images"] != out["intermediates"]["draw"]
    expected = WorkflowRunner({"toy-digits": engine}).run(
        "toy.digits_then_refine", [GenerationRequest(PROMPTS[0], seed=s, sampler="ode") for s in (5, 6)]).images
    decoded = torch.stack([torch.from_numpy(np.array(Image.open(io.BytesIO(base64.b64decode(png))))) for png in
                           out["images"]]).float() / 255
    assert torch.allclose(decoded, expected[:, 0], atol=0.5 / 255 + 1e-6)  # 8-bit PNG rounding
    assert unknown_status == 404
    assert unknown["error"] == "unknown generator card 'toy.nope'; known: toy-digits; workflows: toy.digits_then_refine"
    assert latents_status == 400
