"""The remote-reward wire format: images as safetensors (exact) or PNG, prompts and metadata as JSON.

No pickle anywhere: a request is either a safetensors body whose header
metadata holds the prompts and metadata as JSON strings, or a JSON body with
base64 PNG images. A response is JSON {"scores": [float | null]}, null for a
non-finite score (JSON has no NaN).

Audio [B, channels, samples] and whole videos [B, C, F, H, W], for scorers
that ask for them (see rewards.types), travel only in a safetensors body, as
float32 tensors "audio" and "videos" beside "images", with the sample rate in
the header ("sample_rate", decimal text). Videos are large (4 bytes per
value: 8 clips of 3x33x480x832 take 1.3 GB), so mind the server's
--max-body-bytes when a remote reward asks for them.
"""

from __future__ import annotations

import base64
import io
import json
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from rewards.types import check_audio, check_pixel_range, check_videos

SAFETENSORS = "application/vnd.flywheel.safetensors"
JSON = "application/json"
ENCODINGS = ("safetensors", "png")


@dataclass
class ScoringRequest:
    """One decoded scoring request: the batch and, when sent, its audio (with sample rate) and videos."""

    images: torch.Tensor
    prompts: list[str]
    metadata: list[dict]
    audio: torch.Tensor | None = None
    sample_rate: int | None = None
    videos: torch.Tensor | None = None


def encode_request(images: torch.Tensor, prompts: list[str], metadata: list[dict], encoding: str = "safetensors",
                   *, audio: torch.Tensor | None = None, sample_rate: int | None = None,
                   videos: torch.Tensor | None = None) -> tuple[bytes, str]:
    """(body, content type) of a scoring request; images [B, C, H, W] in [0, 1] (audio and videos: see above)."""
    if encoding == "safetensors":
        header = {"prompts": json.dumps(list(prompts)), "metadata": json.dumps(list(metadata))}
        tensors = {"images": _float32(images)}
        if audio is not None:
            header["sample_rate"] = str(check_audio(audio, sample_rate, images.shape[0]))
            tensors["audio"] = _float32(audio)
        if videos is not None:
            check_videos(videos, images.shape[0])
            tensors["videos"] = _float32(videos)
        return st_save(tensors, metadata=header), SAFETENSORS
    if encoding == "png":
        if audio is not None or videos is not None:
            raise ValueError("audio and videos travel only in a safetensors request; use encoding='safetensors' "
                             "for a reward that needs them")
        pngs = [base64.b64encode(png_bytes(img)).decode("ascii") for img in quantise(images)]
        body = {"images": pngs, "channels": int(images.shape[1]), "prompts": list(prompts),
                "metadata": list(metadata)}
        return json.dumps(body).encode(), JSON
    raise ValueError(f"image encoding {encoding!r} is not known; valid encodings: {', '.join(ENCODINGS)}")


def _list_of(value, kind: type, key: str) -> list:
    """`value` if it is a list of `kind`; ValueError naming `key` otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise ValueError(f"{key!r} must be a list of {kind.__name__}, got {type(value).__name__}")
    return value


def _decode_json(body: bytes, max_image_pixels: int | None,
                 max_decoded_bytes: int | None) -> tuple[torch.Tensor, list[str], list[dict]]:
    """images, prompts and metadata of a JSON/PNG request; ValueError naming the first key that is wrong, and
    RequestTooLarge, from the PNG headers before any pixel is decompressed, for an image over the limits."""
    def bad(what: str) -> ValueError:
        return ValueError(f"bad JSON/PNG scoring request: {what}; a request is {JSON_SHAPE}")

    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise bad(f"the body is a JSON {type(data).__name__}, not an object")
    missing = [k for k in ("images", "channels", "prompts", "metadata") if k not in data]
    if missing:
        raise bad(f"no {', '.join(map(repr, missing))}")
    unknown = sorted(set(data) - {"images", "channels", "prompts", "metadata"})
    if unknown:  # a field the server does not read would be dropped unseen
        raise bad(f"{', '.join(map(repr, unknown))} is not a field of a request")
    try:
        pngs = _list_of(data["images"], str, "images")
        prompts, metadata = _list_of(data["prompts"], str, "prompts"), _list_of(data["metadata"], dict, "metadata")
    except ValueError as exc:
        raise bad(str(exc)) from None
    channels = data["channels"]
    if channels not in (1, 3) or isinstance(channels, bool):
        raise bad(f"'channels' is {channels!r}, not 1 or 3")
    if not pngs:
        raise bad("'images' is empty")
    decoded, decoded_bytes = [], 0
    for i, text in enumerate(pngs):
        try:
            png = open_png(base64.b64decode(text, validate=True))
        except Exception as exc:
            raise bad(f"images[{i}] is not a base64 PNG ({exc})") from None
        width, height = png.size
        check_image_pixels(f"images[{i}]", height, width, max_image_pixels)
        decoded_bytes += width * height * channels * 4  # as the float32 tensor it becomes
        if max_decoded_bytes is not None and decoded_bytes > max_decoded_bytes:
            raise RequestTooLarge(f"images[0..{i}] decode to {decoded_bytes} bytes of float32 pixels, over the "
                                  f"server's {max_decoded_bytes} (its --max-body-bytes, the most a safetensors "
                                  f"request may carry): send fewer images per request")
        try:
            decoded.append(png_pixels(png, channels))
        except Exception as exc:  # a truncated or corrupt PNG fails when its pixels are read
            raise bad(f"images[{i}]: the PNG cannot be decoded ({type(exc).__name__}: {exc})") from None
    if len({tuple(img.shape) for img in decoded}) > 1:
        raise bad(f"the images differ in size ({sorted({tuple(img.shape) for img in decoded})})")
    return torch.stack(decoded), prompts, metadata


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().cpu().contiguous()


JSON_SHAPE = ('{"images": [base64 PNG, ...], "channels": 1 or 3, "prompts": [str, ...], '
              '"metadata": [{...}, ...]}')
SAFETENSORS_SHAPE = ('a tensor "images" [B, C, H, W] (and "audio", "videos" when the reward asks for them), '
                     'with "prompts" and "metadata" as JSON text in the header')


def decode_request(body: bytes, content_type: str, max_image_pixels: int | None = None,
                   max_decoded_bytes: int | None = None) -> ScoringRequest:
    """The `ScoringRequest` in a request body; ValueError on anything malformed, naming what was wrong and the
    shape a request has.

    RequestTooLarge (a ValueError) for an image or video frame of more than `max_image_pixels` pixels, or PNG
    images that decode to more than `max_decoded_bytes` of float32: a small PNG can inflate into gigabytes, so
    both are read from the PNG headers before any pixel is decompressed. None: no limit."""
    audio = videos = sample_rate = None
    if content_type == SAFETENSORS:
        try:
            tensors = st_load(body)
            header = _safetensors_header(body)
        except Exception as exc:
            raise ValueError(f"bad safetensors scoring request: {exc}; a request is {SAFETENSORS_SHAPE}") from None
        missing = (["images"] if "images" not in tensors else []) + [k for k in ("prompts", "metadata")
                                                                     if k not in header]
        if missing:
            raise ValueError(f"bad safetensors scoring request: no {', '.join(map(repr, missing))}; a request is "
                             f"{SAFETENSORS_SHAPE}")
        # A name the server does not read would be dropped unseen (a mistyped "video", "prompt"): refused.
        unknown = sorted(set(tensors) - {"images", "audio", "videos"}) + sorted(
            set(header) - {"prompts", "metadata", "sample_rate"})
        if unknown:
            raise ValueError(f"bad safetensors scoring request: {', '.join(map(repr, unknown))} is not read by the "
                             f"server; a request is {SAFETENSORS_SHAPE}")
        images = tensors["images"]
        try:
            prompts = _list_of(json.loads(header["prompts"]), str, "prompts")
            metadata = _list_of(json.loads(header["metadata"]), dict, "metadata")
            audio, videos = tensors.get("audio"), tensors.get("videos")
            if audio is not None:
                sample_rate = int(header.get("sample_rate", "0"))
        except (ValueError, TypeError, RecursionError) as exc:
            raise ValueError(f"bad safetensors scoring request: {exc}; a request is {SAFETENSORS_SHAPE}") from None
        for key, tensor in (("images", images), ("audio", audio), ("videos", videos)):
            if tensor is not None and not tensor.is_floating_point():
                raise ValueError(f"bad safetensors scoring request: {key!r} is {tensor.dtype}; send float pixels "
                                 f"in [0, 1] (audio: in [-1, 1])")
    elif content_type == JSON:
        images, prompts, metadata = _decode_json(body, max_image_pixels, max_decoded_bytes)
    else:
        raise ValueError(f"content type {content_type!r} is not accepted; send {SAFETENSORS} or {JSON}")
    if images.ndim != 4 or len(prompts) != images.shape[0] or len(metadata) != images.shape[0]:
        raise ValueError(f"scoring request has images {tuple(images.shape)}, {len(prompts)} prompts and "
                         f"{len(metadata)} metadata dicts; expected [B, C, H, W] and B of each")
    if images.shape[1] not in (1, 3) or images.shape[0] < 1 or images.shape[2] < 1 or images.shape[3] < 1:
        raise ValueError(f"scoring request has images {tuple(images.shape)}; expected [B, C, H, W] with B, H, "
                         f"W >= 1 and C 1 or 3")
    check_image_pixels("images", images.shape[2], images.shape[3], max_image_pixels)
    if videos is not None and videos.ndim == 5:
        check_image_pixels("videos' frames", videos.shape[3], videos.shape[4], max_image_pixels)
    check_pixel_range("scoring request's images", images)
    if audio is not None:
        sample_rate = check_audio(audio, sample_rate, images.shape[0])
    if videos is not None:
        check_videos(videos, images.shape[0])
        check_pixel_range("scoring request's videos", videos)
    return ScoringRequest(images, prompts, metadata, audio, sample_rate, videos)


def _safetensors_header(body: bytes) -> dict[str, str]:
    """The __metadata__ dict of a safetensors buffer (8-byte little-endian length, then JSON)."""
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + n]).get("__metadata__", {})


def quantise(images: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] -> the uint8 values a PNG stores, back as float in [0, 1] (what PNG transport yields)."""
    return (images.detach().float().clamp(0, 1) * 255).round() / 255


def png_bytes(image: torch.Tensor) -> bytes:
    """One image [C, H, W] in [0, 1] (C = 1 or 3) as PNG bytes."""
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).save(buffer, format="PNG")
    return buffer.getvalue()


class RequestTooLarge(ValueError):
    """A scoring request over the server's size limits (answered 413, not 400)."""


def check_image_pixels(what: str, height: int, width: int, max_pixels: int | None) -> None:
    """RequestTooLarge when an image of height x width has more than `max_pixels` pixels (None: no limit)."""
    if max_pixels is not None and height * width > max_pixels:
        raise RequestTooLarge(f"{what} are {width}x{height} = {height * width} pixels, over the server's "
                              f"--max-image-pixels {max_pixels}")


def open_png(data: bytes) -> Image.Image:
    """The PNG in `data`, opened lazily: its size is known, no pixel is decompressed yet. ValueError for bytes
    that are not a PNG (a JPEG too: it would be scored with its compression artefacts)."""
    image = Image.open(io.BytesIO(data))
    if image.format != "PNG":
        raise ValueError(f"a {image.format} image, not a PNG")
    return image


def png_pixels(image: Image.Image, channels: int) -> torch.Tensor:
    """An opened PNG -> [C, H, W] float in [0, 1]."""
    with warnings.catch_warnings():  # the caller has bounded the size: PIL's bomb warning would only be noise
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = image.convert("L" if channels == 1 else "RGB")
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 2:
        array = array[..., None]
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255


def from_png(data: bytes, channels: int) -> torch.Tensor:
    """PNG bytes -> [C, H, W] float in [0, 1]."""
    return png_pixels(open_png(data), channels)


def encode_scores(scores: torch.Tensor) -> bytes:
    """JSON {"scores": [...]} with null for non-finite values."""
    values = [v if math.isfinite(v) else None for v in torch.as_tensor(scores).float().tolist()]
    return json.dumps({"scores": values}).encode()


def decode_scores(body: bytes, batch: int) -> torch.Tensor:
    """float32 [batch] from a JSON response {"scores": [number | null]}; null and ±inf -> NaN (a masked row).

    ValueError naming what came back for anything else: not JSON, no "scores" list, the wrong
    length, or an entry that is not a number (a string, a bool, a list, a number too big for a float).
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"reply is not JSON ({exc}); starts with {_preview(body)}") from None
    values = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(values, list):
        raise ValueError(f'reply has no "scores" list; expected {{"scores": [number | null, ...]}}, '
                         f"got {_preview(body)}")
    if len(values) != batch:
        raise ValueError(f"server returned {len(values)} scores for a batch of {batch}")
    return torch.tensor([_score(v, i) for i, v in enumerate(values)], dtype=torch.float32)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _score(value: object, index: int) -> float:
    """One score as a float: null and non-finite numbers are NaN; anything that is not a number is an error."""
    if value is None:
        return float("nan")
    # bool is an int in Python, but true/false is not a score.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"score {index} is {json.dumps(value)[:80]}, not a number or null")
    try:
        score = float(value)
    except OverflowError:
        raise ValueError(f"score {index} ({str(value)[:20]}...) is too large for a float") from None
    if math.isfinite(score) and abs(score) > FLOAT32_MAX:
        # It would be inf as the float32 it becomes, and masked as if the server had sent null.
        raise ValueError(f"score {index} ({score:g}) is beyond float32's range (±{FLOAT32_MAX:.3g})")
    return score if math.isfinite(score) else float("nan")


COVERAGE_SHAPE = '{"prompts": [str, ...], "metadata": [object, ...]} (one metadata object per prompt)'


def encode_coverage_request(prompts: list[str], metadata: list[dict]) -> bytes:
    """The body of POST /coverage: the prompts and their metadata, no images."""
    return json.dumps({"prompts": list(prompts), "metadata": list(metadata)}).encode()


def decode_coverage_request(body: bytes) -> tuple[list[str], list[dict]]:
    """(prompts, metadata) of a POST /coverage body; ValueError naming what is wrong."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"bad coverage request: not JSON ({exc}); a request is {COVERAGE_SHAPE}") from None
    if not isinstance(data, dict) or "prompts" not in data or "metadata" not in data:
        raise ValueError(f"bad coverage request: a request is {COVERAGE_SHAPE}")
    if set(data) - {"prompts", "metadata"}:
        raise ValueError(f"bad coverage request: {', '.join(map(repr, sorted(set(data) - {'prompts', 'metadata'})))} "
                         f"is not a field; a request is {COVERAGE_SHAPE}")
    prompts, metadata = _list_of(data["prompts"], str, "prompts"), _list_of(data["metadata"], dict, "metadata")
    if len(prompts) != len(metadata):
        raise ValueError(f"bad coverage request: {len(prompts)} prompts but {len(metadata)} metadata objects")
    return prompts, metadata


def decode_coverage(body: bytes, rows: int) -> list[bool]:
    """The `scored` list of a POST /coverage reply {"scored": [bool, ...]}, one per row; ValueError otherwise."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"reply is not JSON ({exc}); starts with {_preview(body)}") from None
    scored = data.get("scored") if isinstance(data, dict) else None
    if not isinstance(scored, list) or not all(isinstance(v, bool) for v in scored):
        raise ValueError(f'reply has no "scored" list of true/false; got {_preview(body)}')
    if len(scored) != rows:
        raise ValueError(f"server answered for {len(scored)} rows of {rows}")
    return scored


def _preview(body: bytes, limit: int = 120) -> str:
    """The first bytes of a reply, for an error message."""
    return repr(body[:limit]) + ("..." if len(body) > limit else "")
