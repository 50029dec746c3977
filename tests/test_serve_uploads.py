"""HTTP: an uploaded source image / first frame ("image": base64 PNG, size-limited) and audio for cards with sound.

Unit tests parse and limit the fields; the end-to-end tests serve the tiny
wan2.1-i2v card (a first frame uploaded over HTTP gives the video the engine
makes from the same image on disk) and the tiny ltx2 card (each sample's
waveform comes back as a WAV equal to the engine's audio at 16-bit precision).
"""

import asyncio
import base64
import io
import json
import wave

import numpy as np
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from engine import AdmissionController, AsyncEngine, Engine, GenerationRequest, load_model
from engine.serve import BadRequest, build_app, decode_image_field, parse_generate, wav_base64


def png_b64(array: np.ndarray, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def gradient(height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256],
                    axis=-1).astype(np.uint8)


def serve(model, check, **app_kwargs):
    async def main():
        engine = AsyncEngine(Engine(model), max_batch=8, max_wait_ms=5, admission=AdmissionController(8 * 1024**3))
        server = TestServer(build_app(engine, **app_kwargs), host="127.0.0.1", port=0)
        async with TestClient(server) as client:
            return await check(client)

    return asyncio.run(main())


# ---- request parsing and limits ---------------------------------------------------------------------

def test_image_field_decodes_a_png_and_names_each_limit():
    pixels = gradient(6, 10)
    image = decode_image_field(png_b64(pixels))
    assert image.mode == "RGB" and image.size == (10, 6) and np.array_equal(np.array(image), pixels)
    with pytest.raises(BadRequest, match="field 'image' must be a base64 PNG string; it is not valid base64"):
        decode_image_field("not base64!")
    with pytest.raises(BadRequest, match="field 'image' must be a base64 PNG, got a JPEG image"):
        decode_image_field(png_b64(pixels, "JPEG"))
    with pytest.raises(BadRequest, match="the bytes are not an image"):
        decode_image_field(base64.b64encode(b"hello, not a png").decode())
    with pytest.raises(BadRequest, match="at most 59 pixels, got 10x6 = 60"):
        decode_image_field(png_b64(pixels), max_pixels=59)
    decode_image_field(png_b64(pixels), max_pixels=60)  # ...the limit is inclusive
    raw_size = len(base64.b64decode(png_b64(pixels)))
    with pytest.raises(BadRequest, match=f"at most {raw_size - 1} bytes of PNG"):
        decode_image_field(png_b64(pixels), max_bytes=raw_size - 1)
    decode_image_field(png_b64(pixels), max_bytes=raw_size)
    with pytest.raises(BadRequest, match="at most 10 bytes of PNG .base64 16 characters., got"):
        decode_image_field(png_b64(gradient(64, 64)), max_bytes=10)  # refused on its length, before decoding


def test_pixel_limit_is_read_from_the_header_before_decompressing():
    """A PNG of 4000 x 4000 black pixels compresses to a few KiB; the pixel limit refuses it from its header."""
    b64 = png_b64(np.zeros((4000, 4000, 3), dtype=np.uint8))
    assert len(b64) < 200_000
    with pytest.raises(BadRequest, match="at most 4194304 pixels, got 4000x4000 = 16000000"):
        decode_image_field(b64)


def test_parse_generate_checks_the_upload_fields_with_a_400():
    requests, options = parse_generate({"prompt": "p", "n": 2, "image": png_b64(gradient(4, 4))}, "toy-digits", 4)
    assert len(requests) == 2 and all(r.image is None for r in requests) and options["image"].size == (4, 4)
    for body, message in [({"prompt": "p", "image": 3}, "field 'image' must be a base64 PNG string"),
                          ({"prompt": "p", "audio": "yes"}, "field 'audio' must be true or false"),
                          ({"prompt": "p", "audio_noise_level": "x"}, "field 'audio_noise_level' must be a number"),
                          ({"prompt": "p", "image": "%%"}, "not valid base64")]:
        with pytest.raises(BadRequest, match=message) as err:
            parse_generate(body, "toy-digits", 4)
        assert err.value.status == 400
    with pytest.raises(BadRequest, match="at most 15 pixels"):
        parse_generate({"prompt": "p", "image": png_b64(gradient(4, 4))}, "toy-digits", 4, image_limits=(10**6, 15))


def test_wav_base64_is_16_bit_pcm_of_the_clip():
    clip = torch.tensor([[0.0, 0.5, -1.0, 1.0], [0.25, -0.25, 2.0, float("nan")]])
    with wave.open(io.BytesIO(base64.b64decode(wav_base64(clip, 16000))), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()) == (2, 2, 16000, 4)
        pcm = np.frombuffer(f.readframes(4), dtype="<i2").reshape(4, 2).T
    # x·32767 rounded, clamped to [-1, 1], NaN as silence; channels interleaved per frame.
    assert pcm.tolist() == [[0, 16384, -32767, 32767], [8192, -8192, 32767, 0]]


def test_an_image_for_a_card_that_takes_none_is_a_400(toy_model):
    async def check(client):
        resp = await client.post("/v1/generate", json={"prompt": "a seven", "image": png_b64(gradient(8, 8))})
        return resp.status, (await resp.json())["error"]

    status, error = serve(toy_model, check)
    assert status == 400 and "field 'image': card 'toy-digits' takes no source image" in error


# ---- end to end: an uploaded first frame (wan2.1-i2v) -------------------------------------------------

@pytest.fixture(scope="module")
def i2v_model(tmp_path_factory):
    from tiny_models.wan_i2v import build_tiny_wan_i2v

    return load_model("wan2.1-i2v", path=str(build_tiny_wan_i2v(tmp_path_factory.mktemp("i2v") / "wan-i2v")))


def test_an_uploaded_first_frame_gives_the_engines_video_of_that_image(i2v_model, tmp_path, monkeypatch):
    import tempfile

    uploads = tmp_path / "uploads"
    uploads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(uploads))  # where the server writes the upload for the card
    pixels = gradient(16, 32)
    body = {"prompt": "a boat", "seed": 7, "n": 2, "steps": 2, "sampler": "ode", "height": 16, "width": 32,
            "frames": 5, "image": png_b64(pixels), "return_latents": True}

    async def check(client):
        ok = await client.post("/v1/generate", json=body)
        missing = await client.post("/v1/generate", json={k: v for k, v in body.items() if k != "image"})
        large = await client.post("/v1/generate", json={**body, "image": png_b64(gradient(64, 64))})
        return ok.status, await ok.json(), missing.status, await missing.json(), large.status, await large.json()

    status, out, missing_status, missing, large_status, large = serve(i2v_model, check, max_image_pixels=1024)
    assert status == 200 and out["card"] == "wan2.1-i2v" and len(out["images"]) == 2 and len(out["images"][0]) == 5
    assert missing_status == 400 and "field 'image' is required" in missing["error"]
    assert large_status == 400 and "at most 1024 pixels, got 64x64" in large["error"]

    path = tmp_path / "frame.png"
    Image.fromarray(pixels).save(path)
    expected = Engine(i2v_model).generate([GenerationRequest(prompt="a boat", seed=s, steps=2, sampler="ode",
                                                             card="wan2.1-i2v", height=16, width=32, frames=5,
                                                             image=str(path)) for s in (7, 8)])
    from safetensors.torch import load as load_safetensors

    latents = load_safetensors(base64.b64decode(out["tensors"]))["latents"]
    assert (latents[:, -1] - expected.latents[:, -1]).abs().max() <= 1e-5
    # The first frame matters: another image gives another video.
    other = Engine(i2v_model).generate([GenerationRequest(prompt="a boat", seed=7, steps=2, sampler="ode",
                                                          card="wan2.1-i2v", height=16, width=32, frames=5,
                                                          image=str(_save(tmp_path / "flat.png", 16, 32)))])
    assert (other.latents[0, -1] - latents[0, -1]).abs().max() > 1e-3
    assert not list(uploads.iterdir())  # the upload's file is gone once its request is answered


def _save(path, height, width):
    Image.fromarray(np.full((height, width, 3), 200, dtype=np.uint8)).save(path)
    return path


# ---- end to end: audio of a card with sound (ltx2) -----------------------------------------------------

@pytest.fixture(scope="module")
def ltx2_model(tmp_path_factory):
    from tiny_models.ltx2 import build_tiny_ltx2

    return load_model("ltx2", path=str(build_tiny_ltx2(tmp_path_factory.mktemp("ltx2") / "ltx2")))


def test_audio_comes_back_as_a_wav_per_sample_with_its_sample_rate(ltx2_model):
    body = {"prompt": "rain", "seed": 3, "n": 2, "steps": 2, "sampler": "ode", "height": 32, "width": 64,
            "frames": 5, "audio": True}

    async def check(client):
        with_audio = await client.post("/v1/generate", json=body)
        without = await client.post("/v1/generate", json={**body, "audio": False})
        return await with_audio.json(), await without.json()

    out, silent = serve(ltx2_model, check)
    assert "audio" not in silent and "audio_sample_rate" not in silent
    expected = Engine(ltx2_model).generate([GenerationRequest(prompt="rain", seed=s, steps=2, sampler="ode",
                                                              card="ltx2", height=32, width=64, frames=5, audio=True)
                                            for s in (3, 4)])
    assert out["audio_sample_rate"] == expected.audio_sample_rate and len(out["audio"]) == 2
    for clip, wav in zip(expected.audio, out["audio"]):
        with wave.open(io.BytesIO(base64.b64decode(wav)), "rb") as f:
            assert f.getframerate() == expected.audio_sample_rate and f.getnchannels() == clip.shape[0]
            pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, clip.shape[0]).T
        assert pcm.shape == tuple(clip.shape)
        assert np.abs(pcm / 32767.0 - clip.numpy()).max() <= 0.5 / 32767 + 1e-6
        assert np.abs(pcm).max() > 0  # not silence
    assert json.dumps(out)  # plain JSON
