"""POST /v1/weights with the LoRA a run exports (flywheel.lora.save_lora_for_diffusers): fused into the served
weights, the version bumped, the served samples those of the trained model (toy card and a tiny SD3)."""

import asyncio
import base64
import copy

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from safetensors.torch import load as load_safetensors

from engine import AsyncEngine, Engine, GenerationRequest, load_model
from engine.cards import get_card
from engine.serve import build_app
from flywheel.lora import add_lora, save_lora_for_diffusers


def serve(model, check):
    async def main():
        server = TestServer(build_app(AsyncEngine(Engine(model), max_batch=8, max_wait_ms=5)), host="127.0.0.1",
                            port=0)
        async with TestClient(server) as client:
            return await check(client)

    return asyncio.run(main())


def trained_copy(model, card: str, scale: float, seed: int = 0):
    """`model` with a LoRA as a run trains it (rank 4, alpha 8, the card's targets) and random adapter weights
    (B != 0, so the adapter moves the samples)."""
    trained = copy.deepcopy(model)
    names = add_lora(trained.transformer, 4, 8.0, get_card(card).defaults["lora_targets"])
    generator = torch.Generator().manual_seed(seed)
    state = trained.transformer.state_dict()
    with torch.no_grad():
        for name in names:
            state[name].copy_(scale * torch.randn(state[name].shape, generator=generator))
    return trained


def export(trained, folder) -> str:
    save_lora_for_diffusers(trained.transformer, folder, "StableDiffusion3Pipeline")  # what the run writes to lora/
    return str(folder)


def served_latents(reply: dict) -> torch.Tensor:
    return load_safetensors(base64.b64decode(reply["tensors"]))["latents"]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Fused (W + s·B·A)·x against W·x + s·B·(A·x): equal up to float32 rounding."""
    return bool((a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("card", ["toy-digits", "sd3"])
def test_a_runs_lora_is_fused_into_the_served_weights_and_a_second_one_replaces_it(card, tmp_path):
    if card == "sd3":
        from tiny_models.core import build_tiny_sd3

        model = load_model("sd3", path=str(build_tiny_sd3(tmp_path / "sd3")))
        fields = dict(height=32, width=32, guidance_scale=2.0)
    else:
        model = load_model(card)
        fields = {}
    base_state = {k: v.clone() for k, v in model.transformer.state_dict().items()}
    first, second = trained_copy(model, card, 0.2, seed=1), trained_copy(model, card, 0.2, seed=2)
    request = dict(prompt="the digit 4", seed=3, steps=3, sampler="ode", card=card, **fields)
    expected = [Engine(m).generate([GenerationRequest(**request)]).latents for m in (model, first, second)]
    body = {k: v for k, v in request.items() if k != "card"} | {"return_latents": True}

    async def check(client):
        replies = [await (await client.post("/v1/generate", json=body)).json()]
        pushes = []
        for version, trained in ((1, first), (2, second)):
            push = await client.post("/v1/weights", json={"path": export(trained, tmp_path / f"lora{version}"),
                                                          "version": version, "component": "transformer",
                                                          "card": card})
            pushes.append((push.status, await push.json()))
            replies.append(await (await client.post("/v1/generate", json=body)).json())
        return replies, pushes, await (await client.get("/v1/weights")).json()

    replies, pushes, versions = serve(model, check)
    layers = sum(1 for n in first.transformer.state_dict() if n.endswith("lora_A.default.weight"))
    for version, (status, push) in enumerate(pushes, start=1):
        assert status == 200, push
        assert push["weight_version"] == version and push["lora"] == {"fused": True, "layers": layers,
                                                                      "restored": 0}
    assert versions == {"weights": {card: 2}}
    base, after_first, after_second = (served_latents(r) for r in replies)
    assert [r["weight_version"] for r in replies] == [0, 1, 2]
    assert torch.equal(base, expected[0])
    assert close(after_first, expected[1]) and close(after_second, expected[2])  # the second replaced the first
    assert (after_first - base).abs().max() > 1e-3 and (after_second - after_first).abs().max() > 1e-3
    # Only the adapted weights changed, each to base + s·B·A of the second LoRA (s = alpha / r = 2).
    served, adapted = model.transformer.state_dict(), second.transformer.state_dict()
    for name, value in served.items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.default.weight" in adapted:
            a, b = adapted[f"{module}.lora_A.default.weight"], adapted[f"{module}.lora_B.default.weight"]
            torch.testing.assert_close(value, base_state[name] + 2.0 * b @ a, rtol=0, atol=1e-6)
        else:
            assert torch.equal(value, base_state[name]), name


def test_a_lora_of_another_model_is_refused_naming_its_layers_and_nothing_changes(tmp_path):
    model = load_model("toy-digits")
    other = trained_copy(model, "toy-digits", 0.2)
    folder = export(other, tmp_path / "lora")
    from safetensors.torch import load_file, save_file

    file = f"{folder}/pytorch_lora_weights.safetensors"
    renamed = {k.replace("blocks.0.", "blocks.7."): v for k, v in load_file(file).items()}
    save_file(renamed, tmp_path / "other.safetensors")
    state = {k: v.clone() for k, v in model.transformer.state_dict().items()}

    async def check(client):
        push = await client.post("/v1/weights", json={"path": str(tmp_path / "other.safetensors"), "version": 1})
        return push.status, (await push.json())["error"], await (await client.get("/v1/weights")).json()

    status, error, versions = serve(model, check)
    assert status == 400 and "LoRA layer(s) are not Linear layers of the served transformer" in error
    assert "blocks.7." in error and versions == {"weights": {"toy-digits": 0}}
    assert all(torch.equal(v, state[k]) for k, v in model.transformer.state_dict().items())
