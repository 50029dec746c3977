"""HTTP serving of an `AsyncEngine` on aiohttp: `python -m engine.serve --card toy-digits`.

Routes
    POST /v1/generate   JSON in: {"prompt": str, "seed": int, "n": int, and any GenerationRequest
                        field (steps, sampler, noise_level, guidance_scale, negative_prompt,
                        sde_window, height, width, frames, card, audio, audio_guidance_scale,
                        audio_noise_level), "image": base64 PNG (the source image or first frame of
                        an image-conditioned card, e.g. wan2.1-i2v; at most --max-image-bytes
                        decoded and --max-image-pixels), "return_latents": bool,
                        "return_log_probs": bool}
                        JSON out: {"card", "weight_version", "seeds", "images": [base64 PNG],
                        "metadata" (the request's, echoed, when it sent one),
                        "tensors": base64 safetensors of latents / log_probs / timesteps (on request),
                        and with "audio": true (cards with sound: ltx2) "audio": [base64 16-bit PCM
                        WAV per sample] and "audio_sample_rate" (Hz)}
                        A "card" that names a served workflow (engine.workflows) runs it: JSON out
                        {"workflow", "weight_versions": {card: version}, "seeds", "images" (the final
                        output), "intermediates": {stage path: images} with "return_intermediates": true}
    GET  /v1/models     the hosted cards, then the served workflows (kind "workflow", "requires")
    GET  /v1/weights    the weight version of each hosted generator
    POST /v1/weights    load a safetensors file into a hosted card (disk weight sync), or fuse a
                        LoRA a run exported into its weights: {"path", "version", "component", "card"}
    GET  /health        liveness (no token needed)

Binds 127.0.0.1 by default; `--token` (or FLYWHEEL_SERVE_TOKEN) requires
`Authorization: Bearer <token>` on /v1 routes, and binding another address
without one logs a warning. Bad input is a 4xx naming what was wrong:
malformed JSON, a bad field or a number out of its range 400, a weights file
that cannot be read or holds non-finite or wrongly typed tensors 400 naming
the file or tensor, a body over the limit or a request that can never fit the
memory budget 413, an unknown card 404 listing the known ones, a body not
received within `body_timeout_s` 408, a body that would take the bodies being
received past `max_inflight_bytes` 503 (retry later). A connection that has not sent its
request headers within `header_timeout_s` is closed. A 500 means a bug in the
server, never bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import io
import json
import math
import os

import torch
from aiohttp import web

from engine.admission import AdmissionController, AdmissionError
from engine.async_engine import AsyncEngine, UnknownCardError
from engine.http_limits import (InflightBudget, LimitExceeded, ServerLimits, add_limit_args, read_body,
                                warn_if_exposed)
from engine.server_flags import FlagParser, check_limits_and_address, check_positive, flag_error
from engine.types import MAX_STEPS, SAMPLERS, GenerationRequest

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
TOKEN_KEY = web.AppKey("token", str)
CARD_KEY = web.AppKey("default_card", str)
MAX_IMAGES_KEY = web.AppKey("max_images", int)
INFLIGHT_KEY = web.AppKey("inflight_bytes", InflightBudget)
# (card, component) -> {weight name: its value before any LoRA was fused in}, so a new LoRA replaces the last one
LORA_BASE_KEY = web.AppKey("lora_base_weights", dict)
WEIGHTS_LOCK_KEY = web.AppKey("weights_lock", asyncio.Lock)
DEFAULT_MAX_BODY_BYTES = 64 * 1024
DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_INFLIGHT_BYTES = 64 * 1024**2  # a thousand full-size bodies being received at once
DEFAULT_HEADER_TIMEOUT_S = 20.0
DEFAULT_BODY_TIMEOUT_S = 20.0  # bodies are small JSON (64 KiB by default)
# An uploaded "image": its decoded PNG bytes and its pixels (width x height). A body carrying one must also
# fit --max-body-bytes (base64 is 4/3 of the bytes): raise that limit to serve image-conditioned cards.
DEFAULT_MAX_IMAGE_BYTES = 8 * 1024**2
DEFAULT_MAX_IMAGE_PIXELS = 2048 * 2048
IMAGE_LIMITS_KEY = web.AppKey("image_limits", tuple)
MAX_SEED = 2**63 - 1
MAX_VERSION = 2**63 - 1  # weight versions travel as int64 in checkpoints and tensors

# JSON field -> (accepted Python types, description for the error message).
_FIELDS = {
    "prompt": ((str,), "a string"),
    "negative_prompt": ((str,), "a string"),
    "seed": ((int,), "an integer"),
    "n": ((int,), "an integer"),
    "steps": ((int,), "an integer"),
    "guidance_scale": ((int, float), "a number"),
    "sampler": ((str,), f"one of {', '.join(SAMPLERS)}"),
    "noise_level": ((int, float), "a number"),
    "sde_window": ((list,), "a [start, end] pair of integers or null"),
    "height": ((int,), "an integer or null"),
    "width": ((int,), "an integer or null"),
    "frames": ((int,), "an integer or null"),
    "card": ((str,), "a card id string"),
    "return_latents": ((bool,), "true or false"),
    "return_log_probs": ((bool,), "true or false"),
    "return_intermediates": ((bool,), "true or false (workflows: every stage's images)"),
    "metadata": ((dict,), "a JSON object"),
    "image": ((str,), "a base64 PNG string (the source image or first frame of an image-conditioned card)"),
    "audio": ((bool,), "true or false (cards with sound, e.g. ltx2: return the audio too)"),
    "audio_guidance_scale": ((int, float), "a number or null"),
    "audio_noise_level": ((int, float), "a number or null"),
    # The adaptive (cached) loop of ODE requests (engine/adaptive.py): 0 = the plain loop.
    "cache_threshold": ((int, float), "a number >= 0"),
    "early_exit": ((int, float), "a number > 0 or null"),
    "cache_order": ((int,), "0 or 1"),
}
_NULLABLE = {"sde_window", "height", "width", "frames", "early_exit", "audio_guidance_scale", "audio_noise_level"}


class BadRequest(ValueError):
    """Input the client must fix; carries the HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


def decode_image_field(value: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                       max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """The PIL image (RGB) of a base64 PNG "image" field; BadRequest naming the field and the limit it breaks.

    The byte limit is checked on the base64 length before decoding, the pixel limit on the PNG header
    before any pixel is decompressed (a small file cannot inflate into a huge image)."""
    import binascii

    from PIL import Image

    if len(value) > 4 * ((max_bytes + 2) // 3):
        raise BadRequest(f"field 'image' is over the limit: at most {max_bytes} bytes of PNG (base64 "
                         f"{4 * ((max_bytes + 2) // 3)} characters), got {len(value)} characters")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("field 'image' must be a base64 PNG string; it is not valid base64") from None
    if len(raw) > max_bytes:
        raise BadRequest(f"field 'image' is over the limit: at most {max_bytes} bytes of PNG, got {len(raw)}")
    try:
        image = Image.open(io.BytesIO(raw))
        fmt, (width, height) = image.format, image.size
    except Exception as exc:  # PIL raises several kinds for bytes that are not an image
        raise BadRequest(f"field 'image' must be a base64 PNG; the bytes are not an image ({type(exc).__name__})"
                         ) from None
    if fmt != "PNG":
        raise BadRequest(f"field 'image' must be a base64 PNG, got a {fmt} image")
    if width * height > max_pixels:
        raise BadRequest(f"field 'image' is over the limit: at most {max_pixels} pixels, got {width}x{height} = "
                         f"{width * height}")
    try:
        return image.convert("RGB")
    except Exception as exc:  # a truncated or corrupt PNG fails when its pixels are read
        raise BadRequest(f"field 'image': the PNG cannot be decoded ({type(exc).__name__}: {exc})") from None


def wav_base64(audio: torch.Tensor, sample_rate: int) -> str:
    """One clip [channels, samples] in [-1, 1] as a base64 16-bit PCM WAV file."""
    import wave

    pcm = (torch.nan_to_num(audio.detach().to("cpu", torch.float64), nan=0.0).clamp(-1.0, 1.0) * 32767).round()
    frames = pcm.to(torch.int16).T.contiguous().numpy().astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(frames.shape[1])
        out.setsampwidth(2)
        out.setframerate(int(sample_rate))
        out.writeframes(frames.tobytes())
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def parse_generate(body: object, default_card: str, max_images: int,
                   image_limits: tuple[int, int] = (DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS)
                   ) -> tuple[list[GenerationRequest], dict]:
    """The requests of a /v1/generate body and its output options; BadRequest naming the field.

    An uploaded "image" is decoded and checked here (options["image"]: a PIL image); the requests carry no
    image path yet: `generate` writes the upload to a file of its own for the card to read."""
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(_FIELDS))}")
    if "prompt" not in body:
        raise BadRequest("field 'prompt' is required (a string)")
    for name, value in body.items():
        types, what = _FIELDS[name]
        if value is None and name in _NULLABLE:
            continue
        # bool is an int in Python; only fields that want a bool accept one.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise BadRequest(f"field '{name}' must be {what}, got {json.dumps(value)[:80]}")
        if isinstance(value, float) and not math.isfinite(value):
            raise BadRequest(f"field '{name}' must be finite, got {value}")
    n = body.get("n", 1)
    if not 1 <= n <= max_images:
        raise BadRequest(f"field 'n' must be in 1..{max_images}, got {n}", status=413 if n > max_images else 400)
    if not 1 <= body.get("steps", 1) <= MAX_STEPS:
        raise BadRequest(f"field 'steps' must be in 1..{MAX_STEPS}, got {body['steps']}")
    seed = body.get("seed", 0)
    if not 0 <= seed <= MAX_SEED - n:
        raise BadRequest(f"field 'seed' must be in 0..{MAX_SEED - n} (seed + n must fit in 63 bits), got {seed}")
    window = body.get("sde_window")
    if window is not None:
        if len(window) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in window):
            raise BadRequest(f"field 'sde_window' must be a [start, end] pair of integers, got {window}")
    if body.get("sampler") == "ode":
        # The ODE draws no noise: a noise field sent with it would be ignored, so the caller hears of it here.
        # A level of 0 is what the ODE uses, and GenerationRequest accepts it, so the server does too.
        ignored = [name for name in ("noise_level", "audio_noise_level") if body.get(name) not in (None, 0)]
        ignored += ["sde_window"] if body.get("sde_window") is not None else []
        if ignored:
            raise BadRequest(f"field(s) {', '.join(ignored)} with sampler 'ode': the ODE draws no noise, so "
                             f"{'it' if len(ignored) == 1 else 'they'} would be ignored; drop "
                             f"{'it' if len(ignored) == 1 else 'them'} or use sampler 'sde' or 'cps'")
    kwargs = {k: v for k, v in body.items()
              if k not in ("n", "seed", "return_latents", "return_log_probs", "return_intermediates", "image")}
    if window is not None:
        kwargs["sde_window"] = tuple(window)
    kwargs.setdefault("card", default_card)
    kwargs["keep_trajectory"] = bool(body.get("return_latents", False))
    try:
        requests = [GenerationRequest(seed=seed + i, **kwargs) for i in range(n)]
    except (TypeError, ValueError) as exc:  # GenerationRequest names the field and the valid range
        raise BadRequest(str(exc)) from None
    options = {"latents": bool(body.get("return_latents", False)),
               "log_probs": bool(body.get("return_log_probs", False)),
               "intermediates": bool(body.get("return_intermediates", False)),
               "image": None if body.get("image") is None else decode_image_field(body["image"], *image_limits)}
    return requests, options


def png_base64(image: torch.Tensor) -> str:
    """One image [C, H, W] in [0, 1] as a base64 PNG (1 channel: grayscale, 3: RGB)."""
    from PIL import Image

    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    if array.shape[0] == 1:
        pil = Image.fromarray(array[0].numpy(), mode="L")
    else:
        pil = Image.fromarray(array[:3].permute(1, 2, 0).contiguous().numpy(), mode="RGB")
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _encode_images(images: torch.Tensor) -> list:
    """PNGs of images [B, C, H, W]; for videos [B, C, F, H, W] a list of frame PNGs per sample."""
    if images.ndim == 5:
        return [[png_base64(video[:, f]) for f in range(video.shape[1])] for video in images]
    return [png_base64(image) for image in images]


async def _read_json(request: web.Request) -> object:
    inflight = request.app[INFLIGHT_KEY]
    # Bodies count against max_inflight_bytes only while being received: once parsed, a request
    # is bounded by max_images and the admission budget instead.
    with inflight.reserve(request):
        raw = await read_body(request, inflight.limits)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, an integer of over 4300 digits, nesting
        # thousands deep
        raise BadRequest(f"body is not valid JSON: {exc}") from None


async def generate(request: web.Request) -> web.Response:
    engine: AsyncEngine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    requests, options = parse_generate(body, request.app[CARD_KEY], request.app[MAX_IMAGES_KEY],
                                       request.app[IMAGE_LIMITS_KEY])
    if engine.is_workflow(requests[0].card):
        if options["image"] is not None:
            raise BadRequest(f"field 'image' is for image-conditioned cards; {requests[0].card!r} is a workflow")
        return await _generate_workflow(engine, requests, options)
    card_engine = engine.engine(requests[0].card)  # an unknown id is a 404 listing the cards and workflows
    if options["intermediates"]:
        raise BadRequest(f"field 'return_intermediates' is for workflows; {requests[0].card!r} is a card")
    conditioned = getattr(card_engine.model, "image_conditioned", False)
    if options["image"] is None and conditioned:
        raise BadRequest(f"field 'image' is required: card {requests[0].card!r} is conditioned on a source image "
                         f"(a base64 PNG)")
    if options["image"] is not None and not conditioned:
        raise BadRequest(f"field 'image': card {requests[0].card!r} takes no source image; only image-conditioned "
                         f"cards (image-to-video, editing) do")
    upload = None
    try:
        if options["image"] is not None:  # the cards read a local file: the upload gets one of its own
            import dataclasses
            import tempfile

            upload = tempfile.TemporaryDirectory(prefix="flywheel-upload-")
            path = os.path.join(upload.name, "image.png")
            await asyncio.to_thread(options["image"].save, path, format="PNG")
            requests = [dataclasses.replace(r, image=path) for r in requests]
        trajectories = await engine.generate(requests)
    finally:
        if upload is not None:
            upload.cleanup()
    images = torch.cat([t.images for t in trajectories])
    # The n images of one call may run in several batches, and a weight push can land between them:
    # each image's version is reported, and weight_version is the oldest (the conservative staleness).
    versions = [t.weight_version for t in trajectories for _ in range(t.images.shape[0])]
    out = {"card": requests[0].card, "weight_version": min(versions), "weight_versions": versions,
           "seeds": [r.seed for r in requests], "images": _encode_images(images),
           # Model calls per image (fewer than the steps when the adaptive loop skipped some).
           "steps_computed": [int(n) for t in trajectories for n in t.steps_computed.tolist()]}
    if requests[0].metadata:  # the caller's tag (and what a card or workflow reads), echoed: not dropped unseen
        out["metadata"] = requests[0].metadata
    if requests[0].audio:  # a card with sound: each sample's waveform beside its video
        out["audio"] = [wav_base64(clip, t.audio_sample_rate) for t in trajectories for clip in t.audio]
        out["audio_sample_rate"] = int(trajectories[0].audio_sample_rate)
    if options["latents"] or options["log_probs"]:
        from safetensors.torch import save

        tensors = {"timesteps": trajectories[0].timesteps.detach().cpu().contiguous()}
        if options["latents"]:
            tensors["latents"] = torch.cat([t.latents for t in trajectories]).detach().cpu().contiguous()
        if options["log_probs"]:
            tensors["log_probs"] = torch.cat([t.log_probs for t in trajectories]).detach().cpu().contiguous()
        out["tensors"] = base64.b64encode(save(tensors)).decode("ascii")
    return web.json_response(out)


async def _generate_workflow(engine: AsyncEngine, requests: list, options: dict) -> web.Response:
    """A served workflow's final images, the weight version of every card that made them, and (on request)
    every stage's images; latents and log-probs belong to one card's rollout, so they are not offered."""
    if options["latents"] or options["log_probs"]:
        raise BadRequest("return_latents / return_log_probs apply to a card's rollout, not to a workflow; "
                         "use return_intermediates for every stage's images")
    out = await engine.run_workflow(requests[0].card, requests, intermediates=options["intermediates"])
    body = {"workflow": out.workflow, "weight_versions": out.weight_versions,
            "seeds": [r.seed for r in requests], "images": _encode_images(out.images)}
    if requests[0].metadata:
        body["metadata"] = requests[0].metadata
    if options["intermediates"]:
        body["intermediates"] = {path: _encode_images(stage.images) for path, stage in out.stages.items()}
    return web.json_response(body)


async def models(request: web.Request) -> web.Response:
    from engine.cards import get_card

    entries = []
    for info in request.app[ENGINE_KEY].models():
        if info["kind"] == "workflow":
            entries.append(info)
            continue
        try:
            info = {**get_card(info["id"]).describe(), **info}
        except KeyError:
            pass  # a card hosted without registration (a scorer added at run time)
        entries.append(info)
    return web.json_response({"models": entries})


async def weights(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"weights": {m["id"]: m["weight_version"] for m in engine.models()
                                          if m["kind"] != "workflow"}})


WEIGHTS_FIELDS = ("card", "component", "path", "version")


async def load_weights(request: web.Request) -> web.Response:
    """Disk weight sync: load a safetensors file the trainer wrote (atomically) into a hosted card.

    Body: {"path": "/abs/file.safetensors" or a folder holding one (a run's lora/), "version": int,
    "component": "transformer", "card": optional}. The file is read and checked here, before the engine
    pauses: readable, every tensor finite, floating point exactly where the weight it replaces is. A LoRA
    file (what a run exports, see engine.lora_fuse) is fused: each adapted weight becomes its value before
    any LoRA + s·B·A, so a second LoRA replaces the first rather than adding to it; weights the new LoRA
    does not adapt get their pre-LoRA values back. Running requests finish on their version; requests that
    arrive meanwhile wait for the new one.
    """
    body = await _read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object with 'path' and 'version'")
    unknown = sorted(set(body) - set(WEIGHTS_FIELDS))
    if unknown:  # a misspelt 'component' or 'card' would load into the default one
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(WEIGHTS_FIELDS)}")
    path, version = body.get("path"), body.get("version")
    if isinstance(path, str) and os.path.isdir(path):
        path = _safetensors_in(path)
    if not isinstance(path, str) or not path.endswith(".safetensors"):
        raise BadRequest("'path' must name a .safetensors file on the server's disk, or a folder holding one "
                         "(a run's lora/)")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise BadRequest(f"'version' must be an integer in 0..{MAX_VERSION} above the current weight version, "
                         f"got {json.dumps(version)[:40]}")
    component, card = body.get("component", "transformer"), body.get("card") or request.app[CARD_KEY]
    if not isinstance(component, str) or not isinstance(card, str):
        raise BadRequest("'component' must be a string such as 'transformer' and 'card' a card id string")
    engine = request.app[ENGINE_KEY]
    module = engine.engine(card).component(component)  # unknown card: 404; unknown component: 400
    async with request.app[WEIGHTS_LOCK_KEY]:  # one push at a time: the pre-LoRA weights are shared state
        state = module.state_dict()
        tensors = await asyncio.to_thread(read_weights, path, state, component)
        bases = request.app[LORA_BASE_KEY].setdefault((card, component), {})
        lora = None
        from engine.lora_fuse import is_lora

        if is_lora(tensors):
            tensors, lora = await asyncio.to_thread(fuse_lora, path, tensors, state, component, bases)
        try:
            result = await engine.load_weights(tensors, version, component=component, card=card)
        except KeyError as exc:  # tensor names that are not in the component
            raise BadRequest(str(exc.args[0] if exc.args else exc)) from None
        except TimeoutError as exc:  # a batch outlived the drain: nothing was loaded, serving goes on
            raise BadRequest(f"weights not loaded (still version {engine.weight_version(card)}): {exc}; "
                             "retry when the running batches are done", status=503) from None
        if lora is None:
            for name in tensors:  # full weights: the new values are the pre-LoRA ones
                bases.pop(name.removeprefix(component + "."), None)
    reply = {"weight_version": result["version"], "component": result["component"], "tensors": result["tensors"]}
    if lora is not None:
        reply["lora"] = lora
    return web.json_response(reply)


def _safetensors_in(folder: str) -> str:
    """The one .safetensors file of a folder (a run's lora/ holds pytorch_lora_weights.safetensors)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if "pytorch_lora_weights.safetensors" in files:
        return os.path.join(folder, "pytorch_lora_weights.safetensors")
    if len(files) != 1:
        raise BadRequest(f"folder {folder} holds {len(files)} .safetensors files ({', '.join(files[:5]) or 'none'}); "
                         "name the file in 'path'", status=404 if not files else 400)
    return os.path.join(folder, files[0])


def fuse_lora(path: str, tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], component: str,
              bases: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """The full weights that fuse the LoRA file at `path` into `state`, from the pre-LoRA values in `bases`
    (filled with the served values of weights adapted for the first time); and a summary for the reply."""
    from safetensors import safe_open

    from engine.lora_fuse import lora_deltas

    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata()
    try:
        deltas = lora_deltas(tensors, metadata, component, state)
    except ValueError as exc:
        raise BadRequest(f"LoRA file {path}: {exc}") from None
    for name in deltas:
        if name not in bases:
            bases[name] = state[name].detach().to("cpu", copy=True)
    fused = {name: base.clone() for name, base in bases.items() if name not in deltas}  # an older LoRA's layers
    for name, delta in deltas.items():
        base = bases[name]
        fused[name] = (base.float() + delta).to(base.dtype)
    return fused, {"fused": True, "layers": len(deltas), "restored": len(fused) - len(deltas)}


def read_weights(path: str, state: dict[str, torch.Tensor], component: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path`, checked against `state` (the component's state dict).

    BadRequest naming the file when it is missing (404) or unreadable (truncated, not safetensors),
    and naming the tensor when it holds NaN/inf or is an integer tensor for a float weight (or
    the reverse): copying it would silently corrupt the served model.
    """
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise BadRequest(f"no safetensors file at {path}", status=404)
    try:
        tensors = load_file(path)
    except Exception as exc:  # the file is bad, not the server: any reader error is the client's to fix
        raise BadRequest(f"cannot read safetensors file {path}: {type(exc).__name__}: {exc}") from None
    for name, tensor in tensors.items():
        # A file may prefix its names with "<component>." (the engine strips it when loading).
        target = state.get(name)
        if target is None:
            target = state.get(name.partition(".")[2])
        if target is not None and target.is_floating_point() != tensor.is_floating_point():
            kind = "floating-point" if target.is_floating_point() else "integer"
            raise BadRequest(f"tensor {name!r} in {path} has dtype {tensor.dtype}, but the {component} weight it "
                             f"replaces is {target.dtype}; send {kind} values")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise BadRequest(f"tensor {name!r} in {path} has {count} non-finite value(s) (NaN or inf); "
                             "refusing to load it")
        if target is not None and tensor.is_floating_point() and tensor.dtype != target.dtype:
            # Finite in the file's dtype is not enough: float64 1e300 is inf once copied into a float32 weight.
            overflow = int((~torch.isfinite(tensor.to(target.dtype))).sum())
            if overflow:
                raise BadRequest(f"tensor {name!r} in {path} has {overflow} value(s) that overflow the {component} "
                                 f"weight's dtype {target.dtype} (largest magnitude "
                                 f"{float(tensor.abs().max()):.3g}); refusing to load it")
    return tensors


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **request.app[ENGINE_KEY].stats()})


@web.middleware
async def errors(request: web.Request, handler):
    """Map client mistakes to 4xx with a message; unexpected errors are real 500s."""
    token = request.app[TOKEN_KEY]
    if token and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'")
    try:
        return await handler(request)
    except (BadRequest, LimitExceeded) as exc:
        return _error(exc.status, str(exc))
    except UnknownCardError as exc:
        return _error(404, str(exc))
    except AdmissionError as exc:
        return _error(413, str(exc))
    except ValueError as exc:  # a model's own validation, e.g. an unsupported size
        return _error(400, str(exc))
    except web.HTTPMethodNotAllowed as exc:  # aiohttp's plain-text page: JSON like every other error
        return _error(405, f"{request.method} {request.path}: not allowed; this route takes "
                           f"{', '.join(sorted(exc.allowed_methods))}")
    except web.HTTPNotFound:
        routes = sorted({f"{r.method} {r.resource.canonical}" for r in request.app.router.routes()
                         if r.method != "HEAD" and r.resource is not None})
        return _error(404, f"{request.method} {request.path}: no such route; the routes: {', '.join(routes)}")


def build_app(engine: AsyncEngine, default_card: str | None = None, token: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_images: int = DEFAULT_MAX_IMAGES,
              max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
              header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
              max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> web.Application:
    """The aiohttp application serving `engine`.

    `max_body_bytes` bounds one request body (413), `max_inflight_bytes` the bodies of all
    requests being received at once (503 while full). `header_timeout_s`: a connection that has
    not sent complete request headers by then is closed (aiohttp's keepalive timer also runs from
    the moment a connection opens, so it is the header bound); `body_timeout_s`: a body not
    received by then is answered 408. `max_image_bytes` / `max_image_pixels` bound an uploaded "image"
    (its PNG bytes, its width x height).
    """
    if token is not None and not token.strip():
        raise ValueError("token is empty: give a non-empty token, or None to serve without one")
    limits = ServerLimits(max_body_bytes, max_inflight_bytes, header_timeout_s, body_timeout_s)
    app = web.Application(middlewares=[errors], **limits.app_kwargs())
    app[ENGINE_KEY] = engine
    app[TOKEN_KEY] = token or ""
    app[MAX_IMAGES_KEY] = max_images
    app[IMAGE_LIMITS_KEY] = (max_image_bytes, max_image_pixels)
    app[INFLIGHT_KEY] = InflightBudget(limits)
    app[LORA_BASE_KEY] = {}
    app[WEIGHTS_LOCK_KEY] = asyncio.Lock()
    generators = [m["id"] for m in engine.models() if m["kind"] == "generator"]
    app[CARD_KEY] = default_card or (generators[0] if generators else "")
    app.router.add_post("/v1/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/weights", weights)
    app.router.add_post("/v1/weights", load_weights)
    app.router.add_get("/health", health)

    async def close_engine(app: web.Application) -> None:
        await engine.aclose()

    app.on_cleanup.append(close_engine)
    return app


def check_flags(args: argparse.Namespace) -> ServerLimits:
    """Every flag of `main`, checked before anything loads; a bad one exits 2 with one `error:` line naming it."""
    from engine.card_folders import check_card_path
    from engine.cards import list_cards
    from engine.workflows import default_registry

    if args.card not in list_cards():
        flag_error(f"--card {args.card}: unknown model card; known cards: {', '.join(list_cards())}")
    try:
        check_card_path(args.card, args.path)
    except ValueError as e:
        flag_error(f"--path {args.path}: {e}" if args.path is not None else f"--path: {e}")
    known = default_registry().ids()
    for workflow_id in args.workflow:
        if workflow_id not in known:
            flag_error(f"--workflow {workflow_id}: unknown workflow; known workflows: {', '.join(known)}")
    args.card_paths = card_paths(args)
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as e:
        flag_error(f"--device {args.device}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        flag_error(f"--device {args.device}: no CUDA device here; use --device cpu")
    for flag, value in (("--max-batch", args.max_batch), ("--max-concurrency", args.max_concurrency),
                        ("--budget-bytes", args.budget_bytes)):
        check_positive(value, flag)
    check_positive(args.max_wait_ms, "--max-wait-ms", integer=False, allow_zero=True)
    for flag, value in (("--max-image-bytes", args.max_image_bytes), ("--max-image-pixels", args.max_image_pixels)):
        check_positive(value, flag)
    limits = check_limits_and_address(args)
    return limits


def card_paths(args: argparse.Namespace) -> dict[str, str | None]:
    """The folder of each card the --workflow flags run besides --card (--card-path CARD=PATH, else None: the
    shipped weights), each checked as --path is; an entry for a card no workflow runs, or for --card, is refused."""
    from engine.card_folders import check_card_path
    from engine.workflows import default_registry

    given: dict[str, str] = {}
    for entry in args.card_path:
        card, sep, path = entry.partition("=")
        if not sep or not card or not path:
            flag_error(f"--card-path {entry}: expected CARD=PATH, e.g. --card-path wan2.1-i2v=/models/wan-i2v")
        given[card] = path
    needed = [c for w in args.workflow for c in default_registry().get(w).requires if c != args.card]
    for card in given:
        if card == args.card:
            flag_error(f"--card-path {card}={given[card]}: {card} is --card, whose folder is --path")
        if card not in needed:
            flag_error(f"--card-path {card}={given[card]}: no --workflow runs card {card!r}; cards they run "
                       f"besides --card: {', '.join(dict.fromkeys(needed)) or 'none'}")
    paths = {}
    for card in dict.fromkeys(needed):
        paths[card] = given.get(card)
        try:
            check_card_path(card, paths[card])
        except ValueError as e:
            flag_error(f"--card-path {card}={paths[card]}: {e}" if paths[card] is not None else
                       f"--workflow needs card {card!r}: its folder {e}; give it with --card-path {card}=PATH")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = FlagParser(description="Serve a model card over HTTP.")
    parser.add_argument("--card", default="toy-digits", help="model card id (see engine.list_cards())")
    parser.add_argument("--path", default=None, help="local weights folder or file (default: shipped weights)")
    parser.add_argument("--workflow", action="append", default=[],
                        help="also serve this workflow id (repeatable); cards it requires besides --card load "
                             "their shipped weights (the toy cards) or the folder --card-path gives")
    parser.add_argument("--card-path", action="append", default=[], metavar="CARD=PATH",
                        help="local weights folder of a card a --workflow runs besides --card (repeatable), "
                             "e.g. --card-path wan2.1-i2v=/models/wan-i2v")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--token", default=os.environ.get("FLYWHEEL_SERVE_TOKEN") or None,
                        help="bearer token required on /v1 routes (default: $FLYWHEEL_SERVE_TOKEN, none)")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--max-concurrency", type=int, default=2)
    parser.add_argument("--budget-bytes", type=int, default=8 * 1024**3, help="admission memory budget")
    parser.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                        help="largest uploaded 'image' (PNG bytes; the body must fit --max-body-bytes too)")
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="largest uploaded 'image' in pixels (width x height)")
    add_limit_args(parser, ServerLimits(DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT_BYTES, DEFAULT_HEADER_TIMEOUT_S,
                                        DEFAULT_BODY_TIMEOUT_S))
    args = parser.parse_args(argv)
    limits = check_flags(args)  # every flag checked before the model loads
    warn_if_exposed(args.host, args.token, "engine server", "--token or $FLYWHEEL_SERVE_TOKEN")

    from engine.engine import Engine

    from engine.workflows import default_registry

    engines = {args.card: Engine.from_card(args.card, path=args.path, device=args.device)}
    for workflow_id in args.workflow:
        for card in default_registry().get(workflow_id).requires:
            if card not in engines:
                engines[card] = Engine.from_card(card, path=args.card_paths.get(card), device=args.device)
    engine = AsyncEngine(engines, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                         max_concurrency=args.max_concurrency, admission=AdmissionController(args.budget_bytes),
                         workflows=args.workflow)
    app = build_app(engine, default_card=args.card, token=args.token, max_image_bytes=args.max_image_bytes,
                    max_image_pixels=args.max_image_pixels, **limits.as_kwargs())
    web.run_app(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
