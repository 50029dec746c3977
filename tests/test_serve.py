"""HTTP serving: routes, every bad input as a clear 4xx, bearer token, 64 concurrent clients on loopback."""

import asyncio
import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import torch
from aiohttp import ClientSession, ClientTimeout, TCPConnector
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image
from safetensors.torch import load as load_safetensors

from engine import AdmissionController, AsyncEngine, Engine, GenerationRequest
from engine.serve import build_app


def serve(toy_model, check, token=None, budget=8 * 1024**3, **app_kwargs):
    """Run `check(client)` against the app on 127.0.0.1, port 0."""

    async def main():
        engine = AsyncEngine(Engine(toy_model), max_batch=32, max_wait_ms=20,
                             admission=AdmissionController(budget))
        server = TestServer(build_app(engine, token=token, **app_kwargs), host="127.0.0.1", port=0)
        async with TestClient(server) as client:
            return await check(client)

    return asyncio.run(main())


async def post_each(client, path: str, bodies: list) -> list[tuple[int, str]]:
    """POST each body (a JSON value, or a raw string sent as is) to `path`: [(status, error message)]."""
    out = []
    for body in bodies:
        raw = body if isinstance(body, str) else json.dumps(body)
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        out.append((resp.status, (await resp.json())["error"]))
    return out


def test_generate_returns_pngs_and_safetensors_matching_the_engine(toy_model):
    body = {"prompt": "a handwritten seven", "seed": 5, "n": 2, "steps": 6, "sampler": "sde",
            "return_latents": True, "return_log_probs": True}

    async def check(client):
        resp = await client.post("/v1/generate", json=body)
        return resp.status, await resp.json()

    status, out = serve(toy_model, check)
    assert status == 200 and out["card"] == "toy-digits" and out["weight_version"] == 0 and out["seeds"] == [5, 6]
    assert "metadata" not in out  # none sent
    expected = Engine(toy_model).generate([GenerationRequest(prompt="a handwritten seven", seed=s, steps=6)
                                           for s in (5, 6)])
    for i, png in enumerate(out["images"]):
        image = Image.open(io.BytesIO(base64.b64decode(png)))
        assert image.size == (8, 8) and image.mode == "L"
        pixels = torch.from_numpy(np.array(image)).float()
        assert (pixels - expected.images[i, 0] * 255).abs().max() <= 0.5 + 1e-3
    tensors = load_safetensors(base64.b64decode(out["tensors"]))
    assert tensors["latents"].shape == (2, 7, 1, 8, 8) and tensors["log_probs"].shape == (2, 6)
    assert (tensors["latents"] - expected.latents).abs().max() <= 1e-5
    assert (tensors["log_probs"] - expected.log_probs).abs().max() <= 1e-4


def test_adaptive_ode_requests_are_served_with_their_model_call_counts(toy_model):
    body = {"prompt": "a handwritten seven", "seed": 5, "n": 2, "steps": 10, "sampler": "ode",
            "cache_threshold": 0.2, "early_exit": None, "return_latents": True}

    async def check(client):
        resp = await client.post("/v1/generate", json=body)
        return resp.status, await resp.json()

    status, out = serve(toy_model, check)
    expected = Engine(toy_model).generate([GenerationRequest(prompt="a handwritten seven", seed=s, steps=10,
                                                             sampler="ode", cache_threshold=0.2) for s in (5, 6)])
    assert status == 200 and out["steps_computed"] == expected.steps_computed.tolist()
    assert all(n < 10 for n in out["steps_computed"])  # the cache skipped some of the 10 model calls
    tensors = load_safetensors(base64.b64decode(out["tensors"]))
    assert (tensors["latents"] - expected.latents).abs().max() <= 1e-5


def test_models_weights_and_health(toy_model):
    async def check(client):
        return [(r.status, await r.json()) for r in
                [await client.get("/v1/models"), await client.get("/v1/weights"), await client.get("/health")]]

    (s1, models), (s2, weights), (s3, health) = serve(toy_model, check)
    assert s1 == s2 == s3 == 200
    (toy,) = models["models"]
    assert toy["id"] == "toy-digits" and toy["kind"] == "generator" and toy["defaults"]["steps"] == 10
    assert weights == {"weights": {"toy-digits": 0}}
    assert health["status"] == "ok"


BAD_INPUTS = [
    ("not json{", 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({"seed": 1}, 400, "'prompt' is required"),
    ({"prompt": 7}, 400, "'prompt' must be a string"),
    ({"prompt": "x", "steps": "ten"}, 400, "'steps' must be an integer"),
    ({"prompt": "x", "steps": True}, 400, "'steps' must be an integer"),
    ({"prompt": "x", "steps": 0}, 400, "'steps' must be in"),
    ({"prompt": "x", "sampler": "ddim"}, 400, "valid samplers"),
    ({"prompt": "x", "noise_level": -1}, 400, "noise_level"),
    ({"prompt": "x", "sde_window": [3]}, 400, "'sde_window'"),
    ({"prompt": "x", "sde_window": [5, 2]}, 400, "sde_window"),
    ({"prompt": "x", "height": 16}, 400, "8x8 images only"),
    ({"prompt": "x", "colour": "red"}, 400, "unknown field(s) colour"),
    ({"prompt": "x", "sampler": "ode", "noise_level": 0.5}, 400,
     "field(s) noise_level with sampler 'ode': the ODE draws no noise, so it would be ignored"),
    ({"prompt": "x", "sampler": "ode", "sde_window": [0, 2], "audio_noise_level": 0.3}, 400,
     "field(s) audio_noise_level, sde_window with sampler 'ode'"),
    ({"prompt": "x", "sampler": "ode", "noise_level": 0, "sde_window": [0, 2]}, 400,
     "field(s) sde_window with sampler 'ode'"),
    ("null", 400, "JSON object"),
    ('{"prompt": "x", "noise_level": NaN}', 400, "must be finite"),
    ("\xff\xfe", 400, "not valid JSON"),
    ({"prompt": "x", "seed": -1}, 400, "'seed' must be in"),
    ({"prompt": "x", "seed": 2**70}, 400, "'seed' must be in"),
    ({"prompt": "x", "noise_level": "NaN"}, 400, "'noise_level' must be a number"),
    ({"prompt": "x", "frames": 4}, 400, "not videos"),
    ({"prompt": "x", "negative_prompt": "y"}, 400, "is used only under classifier-free guidance"),
    ({"prompt": "x", "n": 10_000}, 413, "'n' must be in 1..16"),
    ({"prompt": "x", "card": "sd9"}, 404, "known: toy-digits"),
    ({"prompt": "x" * 100_000}, 413, "body exceeds"),
    # Numbers must be finite and in a sane range: 1e308 once made NaN images with a 200, 10**400 a 500.
    ({"prompt": "x", "guidance_scale": 1e308}, 400, "valid: 0 <= guidance_scale <= 100"),
    ('{"prompt": "x", "guidance_scale": 1' + "0" * 400 + "}", 400, "valid: 0 <= guidance_scale <= 100"),
    ({"prompt": "x", "guidance_scale": -2}, 400, "valid: 0 <= guidance_scale <= 100"),
    ('{"prompt": "x", "guidance_scale": Infinity}', 400, "must be finite"),
    ({"prompt": "x", "noise_level": 1e308}, 400, "valid: 0 <= noise_level <= 10"),
    ('{"prompt": "x", "steps": 1' + "0" * 400 + "}", 400, "'steps' must be in 1..1000"),
    ('{"prompt": "x", "height": 1' + "0" * 400 + "}", 400, "valid: 1 <= height <= 16384"),
    ({"prompt": "x", "width": 0}, 400, "valid: 1 <= width <= 16384"),
    ({"prompt": "x", "frames": -3}, 400, "valid: 1 <= frames <= 4096"),
    ({"prompt": "x", "sde_window": [0, 10**30]}, 400, "sde_window"),
    ({"prompt": "x", "sampler": "ode", "cache_threshold": -1}, 400, "cache_threshold=-1 is out of range"),
    ({"prompt": "x", "sampler": "ode", "cache_order": 2}, 400, "cache_order=2 is out of range"),
    ({"prompt": "x", "sampler": "ode", "early_exit": "soon"}, 400, "'early_exit' must be a number > 0 or null"),
    ({"prompt": "x", "cache_threshold": 0.2}, 400, "skip model calls only on the ODE steps"),
    ('{"prompt": "x", "steps": ' + "[" * 5000 + "]" * 5000 + "}", 400, "not valid JSON: maximum recursion depth"),
    ('{"prompt": "x", "seed": 1' + "0" * 5000 + "}", 400, "not valid JSON: Exceeds the limit (4300 digits)"),
]


def test_every_bad_input_is_a_clear_4xx_never_a_500(toy_model):
    async def check(client):
        out = await post_each(client, "/v1/generate", [body for body, _, _ in BAD_INPUTS])
        good = await client.post("/v1/generate", json={"prompt": "a handwritten one", "steps": 2})
        return out, good.status

    results, good = serve(toy_model, check)
    for (body, status, message), (got_status, got_message) in zip(BAD_INPUTS, results):
        assert got_status == status, (body, got_status, got_message)
        assert message in got_message, (body, got_message)
    assert good == 200  # the server is unharmed


def test_request_fields_are_checked_in_process_too():
    """GenerationRequest refuses wrong types and out-of-range numbers whoever builds it, naming the field."""
    import numpy as np
    import pytest

    cases = [({"steps": True}, TypeError, "steps must be an integer"),
             ({"steps": 2.0}, TypeError, "steps must be an integer"),
             ({"seed": "7"}, TypeError, "seed must be an integer"),
             ({"seed": 2**64}, ValueError, "seed=18446744073709551616 is out of range"),
             ({"guidance_scale": float("nan")}, ValueError, "guidance_scale=nan is out of range"),
             ({"guidance_scale": "4.5"}, TypeError, "guidance_scale must be a number"),
             ({"noise_level": float("inf")}, ValueError, "noise_level=inf is out of range"),
             ({"height": 8.0}, TypeError, "height must be an integer or None"),
             ({"prompt": None}, TypeError, "prompt must be a string"),
             ({"sde_window": (0.5, 2)}, TypeError, "sde_window must be a (start, end) pair")]
    for change, error, message in cases:
        with pytest.raises(error) as err:
            GenerationRequest(**{"prompt": "x", "seed": 0, **change})
        assert message in str(err.value), (change, str(err.value))
    # NumPy scalars are numbers too; the defaults and the edges of each range are valid.
    ok = GenerationRequest(prompt="x", seed=np.int64(3), steps=np.int32(1000), guidance_scale=np.float32(100),
                           noise_level=0, height=16384, width=1, frames=4096)
    assert ok.seed == 3 and GenerationRequest(prompt="x", seed=-(2**63)).seed == -(2**63)


def test_post_weights_refuses_bad_files_naming_the_file_or_tensor(tmp_path):
    """Non-finite or integer tensors, truncated files and absurd versions are 4xx; nothing is loaded."""
    from safetensors.torch import save_file

    from engine import load_model

    served_model = load_model("toy-digits")
    state = {k: v.clone() for k, v in served_model.transformer.state_dict().items()}
    name, first = next((k, v) for k, v in state.items() if v.is_floating_point() and v.numel() > 1)
    nan = {**state, name: first.clone().index_fill_(0, torch.tensor([0]), float("nan"))}
    ints = {**state, name: first.round().to(torch.int32)}
    # Finite as float64, inf once copied into the float32 weight.
    overflow = {**state, name: first.double().index_fill_(0, torch.tensor([0]), 1e300)}
    second = next(k for k in state if k != name)  # one name without the prefix among prefixed ones
    mixed = {**{f"transformer.{k}": v for k, v in state.items() if k != second}, second: state[second]}
    files = {}
    for label, tensors in (("nan", nan), ("ints", ints), ("overflow", overflow), ("mixed", mixed), ("good", state)):
        files[label] = tmp_path / f"{label}.safetensors"
        save_file(tensors, str(files[label]))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(files["good"].read_bytes()[:-100])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    bodies = [({"path": str(files["nan"]), "version": 1}, 400, [f"tensor '{name}'", "non-finite"]),
              ({"path": str(files["ints"]), "version": 1}, 400, [f"tensor '{name}'", "torch.int32", "torch.float32"]),
              ({"path": str(files["overflow"]), "version": 1}, 400,
               [f"tensor '{name}'", f"{first[0].numel()} value(s) that overflow the transformer weight's dtype torch.float32",
                "largest magnitude 1e+300"]),
              ({"path": str(files["mixed"]), "version": 1}, 400,
               ["mix names with the 'transformer.' prefix and without it", f"['{second}']", "would be ignored"]),
              ({"path": str(files["good"]), "version": 1, "compnent": "transformer"}, 400,
               ["unknown field(s) compnent; valid fields: card, component, path, version"]),
              ({"path": str(truncated), "version": 1}, 400, [f"cannot read safetensors file {truncated}"]),
              ({"path": str(garbage), "version": 1}, 400, [f"cannot read safetensors file {garbage}"]),
              ('{"path": "%s", "version": 1%s}' % (files["good"], "0" * 400), 400,
               ["'version' must be an integer in 0.."]),
              ({"path": str(files["good"]), "version": 1, "component": "vae9"}, 400, ["no component 'vae9'"]),
              ({"path": str(files["good"]), "version": 1, "card": "sd9"}, 404, ["known: toy-digits"])]

    async def check(client):
        out = await post_each(client, "/v1/weights", [body for body, _, _ in bodies])
        return out, await (await client.get("/v1/weights")).json()

    results, versions = serve(served_model, check)
    for (body, status, fragments), (got_status, message) in zip(bodies, results):
        assert got_status == status and all(f in message for f in fragments), (body, got_status, message)
    assert versions == {"weights": {"toy-digits": 0}}
    for key, value in served_model.transformer.state_dict().items():  # nothing was copied
        assert torch.equal(value, state[key]), key


def test_bodies_being_received_are_bounded_across_clients(toy_model):
    """A client that announces a body and sends nothing holds its bytes until body_timeout_s; meanwhile a
    body that would pass max_inflight_bytes is a 503, and once the slow one is cut (408) the next fits."""
    body = json.dumps({"prompt": "a handwritten one", "steps": 2}).encode().ljust(150)
    head = (f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    async def check(client):
        reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
        writer.write(head)  # the body never comes
        await writer.drain()
        await asyncio.sleep(0.2)
        busy = await client.post("/v1/generate", data=body, headers={"Content-Type": "application/json"})
        busy = busy.status, (await busy.json())["error"]
        cut = await asyncio.wait_for(reader.read(1000), 5)  # the 408 after body_timeout_s
        writer.close()
        after = await client.post("/v1/generate", data=body, headers={"Content-Type": "application/json"})
        return busy, cut, after.status

    (status, message), cut, after = serve(toy_model, check, max_body_bytes=200, max_inflight_bytes=250,
                                          body_timeout_s=1.0)
    assert status == 503 and "150 bytes of request bodies in flight, max_inflight_bytes=250" in message
    assert cut.startswith(b"HTTP/1.1 408") and after == 200


def test_admission_refusal_is_413(toy_model):
    async def check(client):
        resp = await client.post("/v1/generate", json={"prompt": "x", "steps": 50, "return_latents": True})
        return resp.status, (await resp.json())["error"]

    status, message = serve(toy_model, check, budget=20_000)
    assert status == 413 and "admission budget" in message


def test_bearer_token(toy_model):
    async def check(client):
        missing = await client.get("/v1/models")
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        right = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        health = await client.get("/health")
        return missing.status, wrong.status, right.status, health.status

    assert serve(toy_model, check, token="s3cret") == (401, 401, 200, 200)


def test_64_concurrent_clients_on_loopback_with_zero_errors(toy_model):
    async def check(client):
        url = str(client.make_url("/v1/generate"))
        assert url.startswith("http://127.0.0.1:")

        async def one(i, session):
            async with session.post(url, json={"prompt": "a handwritten four", "seed": i, "steps": 4}) as resp:
                body = await resp.json()
                return resp.status, body.get("seeds")

        async with ClientSession(connector=TCPConnector(limit=64), timeout=ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(one(i, session) for i in range(64)), return_exceptions=True)

    results = serve(toy_model, check)
    errors = [r for r in results if isinstance(r, BaseException) or r[0] != 200]
    assert errors == [] and sorted(r[1][0] for r in results) == list(range(64))


def test_module_entry_point_serves_on_loopback(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--card", "toy-digits", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, health = time.monotonic() + 60, None
        while time.monotonic() < deadline and health is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    health = json.loads(resp.read())
            except OSError:
                time.sleep(0.2)
        assert health is not None and health["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_post_weights_loads_a_safetensors_file_and_later_requests_use_it(tmp_path):
    """Disk weight sync into the HTTP engine: the version moves and outputs follow the new weights."""
    from engine import load_model
    from flywheel.sync.transport import save_weights_atomic

    served_model = load_model("toy-digits")  # its own copy: this test changes the weights
    new = {k: v + 0.02 for k, v in served_model.transformer.state_dict().items()}
    path = save_weights_atomic(new, tmp_path / "transformer.safetensors", version=1)
    body = {"prompt": "the digit 4", "seed": 3, "steps": 4, "sampler": "ode", "return_latents": True}

    async def check(client):
        bad = [await client.post("/v1/weights", json=b) for b in
               ({"path": str(path)}, {"path": "/nope.safetensors", "version": 1}, {"path": "x.txt", "version": 1})]
        loaded = await client.post("/v1/weights", json={"path": str(path), "version": 1})
        stale = await client.post("/v1/weights", json={"path": str(path), "version": 1})
        after = await client.post("/v1/generate", json=body)
        return [r.status for r in bad], loaded.status, await loaded.json(), stale.status, await after.json()

    bad, status, loaded, stale, after = serve(served_model, check)
    assert bad == [400, 404, 400] and status == 200 and stale == 400
    assert loaded["weight_version"] == 1 and loaded["tensors"] == len(new)
    fresh = load_model("toy-digits")
    fresh.transformer.load_state_dict(new)
    expected = Engine(fresh).generate([GenerationRequest(prompt="the digit 4", seed=3, steps=4, sampler="ode")])
    latents = load_safetensors(base64.b64decode(after["tensors"]))["latents"]
    assert after["weight_version"] == 1 and torch.equal(latents, expected.latents)


def test_an_ode_request_with_noise_level_zero_is_served_as_python_takes_it():
    # GenerationRequest(sampler="ode", noise_level=0) is valid (0 is the ODE's level); the server refused it.
    from engine.serve import parse_generate

    requests, _ = parse_generate({"prompt": "a 3", "sampler": "ode", "noise_level": 0, "n": 2}, "toy-digits", 4)
    assert [(r.prompt, r.seed, r.sampler, r.noise_level, r.card) for r in requests] == [
        ("a 3", 0, "ode", 0, "toy-digits"), ("a 3", 1, "ode", 0, "toy-digits")]
    (audio,), _ = parse_generate({"prompt": "a 3", "sampler": "ode", "audio": True, "audio_noise_level": 0.0},
                                 "toy-digits", 4)
    assert audio.audio_noise_level == 0.0


def gated_engine_and_weights(tmp_path):
    """A toy Engine whose generate() waits for the returned Event, and a weights file (version 1) for it."""
    import threading

    from engine import load_model
    from flywheel.sync.transport import save_weights_atomic

    served_model = load_model("toy-digits")  # its own copy: the weights change
    new = {k: v + 0.02 for k, v in served_model.transformer.state_dict().items()}
    path = save_weights_atomic(new, tmp_path / "transformer.safetensors", version=1)
    gate, engine = threading.Event(), Engine(served_model)
    generate = engine.generate
    engine.generate = lambda requests: (gate.wait(10), generate(requests))[1]
    return engine, path, gate


def test_post_weights_while_a_batch_outlives_the_drain_is_503_and_serving_goes_on(tmp_path):
    """The weights are not loaded, the reply says why and that the version stayed, and /v1/generate still
    answers afterwards (the failed pause used to stay in force)."""
    engine, path, release = gated_engine_and_weights(tmp_path)

    async def main():
        ae = AsyncEngine(engine, max_wait_ms=0, drain_timeout_s=0.2)
        async with TestClient(TestServer(build_app(ae), host="127.0.0.1", port=0)) as client:
            slow = asyncio.ensure_future(client.post("/v1/generate", json={"prompt": "a 1", "steps": 2}))
            while ae.stats()["pool/running"] == 0:
                await asyncio.sleep(0.001)
            refused = await client.post("/v1/weights", json={"path": str(path), "version": 1})
            release.set()
            first = await slow
            later = await asyncio.wait_for(client.post("/v1/generate", json={"prompt": "a 2", "steps": 2}), 10)
            return refused.status, await refused.json(), first.status, later.status, await later.json()

    status, body, first, later, reply = asyncio.run(main())
    assert status == 503 and "still version 0" in body["error"] and "did not drain within 0.2s" in body["error"]
    assert first == 200 and later == 200 and reply["weight_version"] == 0


def test_one_call_whose_batches_straddle_a_weight_push_reports_each_images_version(tmp_path):
    """n=4 with max_batch=2: the push lands between the two batches; the reply says which images came from
    which version (it used to report the first batch's version for all four)."""
    engine, path, gate = gated_engine_and_weights(tmp_path)

    async def main():
        ae = AsyncEngine(engine, max_batch=2, max_wait_ms=0, max_concurrency=1)
        async with TestClient(TestServer(build_app(ae), host="127.0.0.1", port=0)) as client:
            call = asyncio.ensure_future(client.post("/v1/generate", json={"prompt": "a 7", "n": 4, "steps": 2}))
            while ae.stats()["pool/running"] == 0:
                await asyncio.sleep(0.001)
            push = asyncio.ensure_future(client.post("/v1/weights", json={"path": str(path), "version": 1}))
            while not ae.paused:
                await asyncio.sleep(0.001)
            gate.set()
            pushed, reply = await push, await call
            return pushed.status, reply.status, await reply.json()

    pushed, status, body = asyncio.run(main())
    assert pushed == 200 and status == 200
    assert body["weight_versions"] == [0, 0, 1, 1] and body["weight_version"] == 0


def test_a_requests_metadata_is_echoed_in_its_reply(toy_model):
    """It was accepted and appeared nowhere in the reply."""
    async def check(client):
        resp = await client.post("/v1/generate", json={"prompt": "a one", "steps": 2, "metadata": {"tag": "abc"}})
        return resp.status, await resp.json()

    status, out = serve(toy_model, check)
    assert status == 200 and out["metadata"] == {"tag": "abc"}


def test_a_wrong_path_or_method_is_a_json_error_naming_the_routes(toy_model):
    async def check(client):
        out = []
        for method, path in (("GET", "/v1/nope"), ("GET", "/v1/generate")):
            resp = await client.request(method, path)
            out.append((resp.status, resp.content_type, (await resp.json())["error"]))
        return out

    (missing, wrong_method) = serve(toy_model, check)
    assert missing[:2] == (404, "application/json") and "GET /v1/nope: no such route" in missing[2]
    assert "POST /v1/generate" in missing[2] and "GET /v1/models" in missing[2]
    assert wrong_method[:2] == (405, "application/json")
    assert wrong_method[2] == "GET /v1/generate: not allowed; this route takes POST"
