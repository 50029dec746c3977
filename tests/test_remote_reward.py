"""Remote rewards: `rewards.serve` + the `remote:<url>` client give in-process scores; failures are clear."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import rewards
from rewards import RewardSet, parse_spec
from rewards.remote import RemoteRewardError, RemoteScorer
from rewards.serve import ServerThread
from rewards.wire import JSON, SAFETENSORS, decode_request, encode_request, quantise

PROMPTS = ["three", "seven", "a 0", "digit 5", "one", "nine"]


def _images() -> torch.Tensor:
    return torch.rand(6, 1, 8, 8, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def digit_server():
    with ServerThread(rewards.get("digit_alignment"), "digit_alignment") as server:
        yield server


def test_spec_syntax_for_remote_entries():
    assert parse_spec("remote:http://127.0.0.1:8100") == [("remote:http://127.0.0.1:8100", 1.0)]
    assert parse_spec("digit_alignment:1,remote:http://127.0.0.1:8100:0.5") == [
        ("digit_alignment", 1.0), ("remote:http://127.0.0.1:8100", 0.5)]
    assert parse_spec({"remote:http://h.example": 2}) == [("remote:http://h.example", 2.0)]
    with pytest.raises(ValueError, match="needs an address"):
        parse_spec("remote:")
    with pytest.raises(ValueError, match="not valid"):
        rewards.get("remote:ftp://127.0.0.1:1")


def test_remote_scores_equal_in_process_scores(digit_server):
    images, local = _images(), rewards.get("digit_alignment")
    exact = RemoteScorer(digit_server.url)  # safetensors: float32 images travel bit for bit
    assert exact.served_reward == "digit_alignment"
    expected = local(images, PROMPTS, [{}] * 6)
    assert torch.equal(exact(images, PROMPTS, [{}] * 6), expected)
    png = RemoteScorer(digit_server.url, encoding="png")  # PNG: the server sees uint8-quantised pixels
    assert torch.equal(png(images, PROMPTS, [{}] * 6), local(quantise(images), PROMPTS, [{}] * 6))
    # Through a spec, weighted like any other scorer; metadata travels as JSON.
    spec = f"remote:{digit_server.url}:0.5"
    batch = RewardSet(spec).score(images, PROMPTS, [{"digit": i} for i in range(6)], weight_version=7)
    direct = RewardSet("digit_alignment:0.5").score(images, PROMPTS, [{"digit": i} for i in range(6)], 7)
    name = f"remote:{digit_server.url}"
    assert batch.scorer_ids == [name] and batch.valid.all()
    assert torch.equal(batch.scores[name], direct.scores["digit_alignment"])
    assert torch.equal(batch.total, direct.total)


def test_nan_scores_cross_the_wire_as_masked_rows():
    def half_nan(images, prompts, metadata):
        out = torch.arange(len(prompts), dtype=torch.float32)
        out[::2] = float("nan")
        return out

    with ServerThread(half_nan, "half_nan") as server:
        batch = RewardSet(f"remote:{server.url}").score(_images(), PROMPTS, None, weight_version=0)
    assert batch.valid.tolist() == [False, True] * 3
    assert batch.total[1::2].tolist() == [1.0, 3.0, 5.0]


def test_token_is_required_when_set(digit_server):
    with ServerThread(rewards.get("jpeg_compressibility"), "jpeg_compressibility", token="s3cret") as server:
        with pytest.raises(RemoteRewardError, match="401") as err:
            RemoteScorer(server.url, token="wrong")
        assert server.url in str(err.value)
        scorer = RemoteScorer(server.url, token="s3cret")
        assert torch.equal(scorer(_images(), PROMPTS, [{}] * 6),
                           rewards.get("jpeg_compressibility")(_images(), PROMPTS, [{}] * 6))


def test_server_side_error_masks_the_batch_with_the_reason():
    def broken(images, prompts, metadata):
        raise RuntimeError("model exploded")

    with ServerThread(broken, "broken") as server:
        batch = RewardSet(f"remote:{server.url}").score(_images(), PROMPTS, None, weight_version=0)
        assert not batch.valid.any()
        error = batch.errors[f"remote:{server.url}"]
        assert "HTTP 500" in error and "model exploded" in error and server.url in error


def test_stopped_server_gives_a_clear_error_in_bounded_time():
    server = ServerThread(rewards.get("jpeg_compressibility"), "jpeg_compressibility")
    scorer = RemoteScorer(server.url, timeout_s=2.0, retries=2, backoff_s=0.05)
    server.stop()
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as err:
        scorer(_images(), PROMPTS, [{}] * 6)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert server.url in message and "did not answer" in message and "3 attempts" in message
    assert "ConnectionRefusedError" in message
    assert elapsed < 30  # bounded: 3 attempts x 2 s timeout + backoff, not a hang
    # Building a client against a dead address fails the health check the same way.
    with pytest.raises(RemoteRewardError, match="did not answer GET /health"):
        RemoteScorer(server.url, retries=0, health_timeout_s=1.0)
    # Inside a RewardSet the batch is masked and the error recorded, the run goes on.
    reward_set = RewardSet("jpeg_compressibility")
    reward_set.scorers["jpeg_compressibility"] = scorer
    batch = reward_set.score(_images(), PROMPTS, None, weight_version=0)
    assert not batch.valid.any() and server.url in batch.errors["jpeg_compressibility"]


def test_serve_module_runs_as_a_command_with_the_token_from_the_environment():
    # The token comes from $FLYWHEEL_REWARD_TOKEN, so it never shows in the process list.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLYWHEEL_REWARD_TOKEN": "t0k"}
    proc = subprocess.Popen([sys.executable, "-m", "rewards.serve", "--reward", "jpeg_compressibility",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = ""
        while "serving reward" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "server exited before printing its address"
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")  # binds the loopback address by default
        with pytest.raises(RemoteRewardError, match="HTTP 401"):
            RemoteScorer(url, token="wrong", retries=0)
        scores = RemoteScorer(url, token="t0k")(_images(), PROMPTS, [{}] * 6)
        assert torch.equal(scores, rewards.get("jpeg_compressibility")(_images(), PROMPTS, [{}] * 6))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_reward_set_passes_remote_timeouts_to_remote_scorers_only(digit_server):
    name = f"remote:{digit_server.url}"
    reward_set = RewardSet(f"digit_alignment,{name}", remote_timeout_s=7, remote_budget_s=9.5)
    assert (reward_set.scorers[name].timeout_s, reward_set.scorers[name].budget_s) == (7.0, 9.5)
    # A scorer's own kwargs win over the set-wide remote settings.
    own = RewardSet(name, scorer_kwargs={name: {"timeout_s": 3.0}}, remote_timeout_s=7)
    assert (own.scorers[name].timeout_s, own.scorers[name].budget_s) == (3.0, 120.0)
    # Bad values are errors naming the setting, even when the spec has no remote entry.
    for kwargs in ({"remote_timeout_s": 0}, {"remote_timeout_s": float("nan")}, {"remote_budget_s": "60"},
                   {"remote_budget_s": float("inf")}, {"remote_timeout_s": True}, {"remote_timeout_s": 1e30},
                   {"remote_budget_s": 604_801}):  # over a week: a socket timeout of 1e30 overflows time_t
        with pytest.raises(ValueError, match=rf"{next(iter(kwargs))} must be a number of seconds in \(0, 604800\]"):
            RewardSet("digit_alignment", **kwargs)
    assert RewardSet("digit_alignment", remote_budget_s=604_800)  # a week is taken


@pytest.mark.parametrize("kwargs, fragment", [
    ({"timeout_s": float("nan")}, "timeout_s must be a number of seconds in"),
    ({"timeout_s": 0}, "timeout_s must be a number of seconds in"),
    ({"timeout_s": 1e30}, r"timeout_s must be a number of seconds in \(0, 604800\]"),
    ({"budget_s": -1.0}, "budget_s must be a number of seconds in"),
    ({"budget_s": float("inf")}, "budget_s must be a number of seconds in"),
    ({"health_timeout_s": float("nan")}, "health_timeout_s must be a number of seconds in"),
    ({"retries": -1}, "retries must be an integer >= 0"),
    ({"retries": 1.5}, "retries must be an integer >= 0"),
    ({"backoff_s": float("nan")}, "backoff_s must be a finite number"),
    ({"max_reply_bytes": 0}, "max_reply_bytes must be a positive integer"),
])
def test_client_settings_are_checked_before_any_request(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        RemoteScorer("http://127.0.0.1:9", **kwargs)  # port 9 (discard): nothing is ever sent


def test_server_bounds_the_bodies_held_across_requests():
    """Bodies waiting for the scorer count against max_inflight_bytes: a third concurrent body is a 503
    (retried by the client within its budget), and the bytes are released when a request finishes."""
    started, release = threading.Event(), threading.Event()

    def slow_sum(images, prompts, metadata):
        started.set()
        release.wait(20)
        return images.flatten(1).sum(1)

    size = len(encode_request(_images(), PROMPTS, [{}] * 6)[0])
    with ServerThread(slow_sum, "slow_sum", max_body_bytes=size, max_inflight_bytes=int(1.5 * size)) as server:
        held: list = []
        first = threading.Thread(target=lambda: held.append(RemoteScorer(server.url)(_images(), PROMPTS, [{}] * 6)))
        first.start()
        assert started.wait(10)
        busy = RemoteScorer(server.url, timeout_s=2.0, budget_s=1.0, retries=20, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError) as err:
            busy(_images(), PROMPTS, [{}] * 6)
        assert time.monotonic() - start < 3.0
        assert "HTTP 503" in str(err.value) and f"max_inflight_bytes={int(1.5 * size)}" in str(err.value)
        assert "attempts" in str(err.value)  # retried: busy is not final
        # One body over the per-body limit is refused outright, not retried.
        with pytest.raises(RemoteRewardError, match=f"HTTP 413.*max_body_bytes={size}"):
            busy(torch.rand(7, 1, 8, 8), PROMPTS + ["x"], [{}] * 7)
        release.set()
        first.join(timeout=10)
        expected = _images().flatten(1).sum(1)
        assert torch.equal(held[0], expected)
        assert torch.equal(busy(_images(), PROMPTS, [{}] * 6), expected)  # the bytes were given back


def test_binding_another_address_without_a_token_warns(caplog):
    from engine.serve import warn_if_exposed

    with caplog.at_level(logging.WARNING):
        assert not warn_if_exposed("127.0.0.1", None, "x", "y")
        assert not warn_if_exposed("localhost", None, "x", "y")
        assert not warn_if_exposed("::1", None, "x", "y")
        assert not warn_if_exposed("0.0.0.0", "secret", "x", "y")
        assert caplog.records == []
        assert warn_if_exposed("0.0.0.0", None, "x", "y") and warn_if_exposed(None, "", "x", "y")
        assert warn_if_exposed("reward-box.internal", None, "x", "y")
        caplog.clear()
        # 192.0.2.1 is a documentation address no machine holds: the warning comes, the bind then fails.
        with pytest.raises(RuntimeError, match="could not bind 192.0.2.1"):
            ServerThread(rewards.get("jpeg_compressibility"), "jpeg_compressibility", host="192.0.2.1")
    (record,) = caplog.records
    assert "192.0.2.1 without a token" in record.getMessage() and "FLYWHEEL_REWARD_TOKEN" in record.getMessage()


def _jpeg_base64() -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (8, 8)).save(buffer, format="JPEG")  # scored, its compression artefacts would count
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _big_png_base64(width: int, height: int) -> str:
    """A black grayscale PNG: a few kB of file for width x height pixels."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (width, height)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _png_body(**change) -> bytes:
    import json

    body, _ = encode_request(torch.rand(2, 1, 8, 8), ["a", "b"], [{}, {}], encoding="png")
    data = json.loads(body)
    data.update(change)
    return json.dumps({k: v for k, v in data.items() if v is not ...}).encode()


# A malformed body: the one-line error names what was wrong, and every one shows the shape a request has.
BAD_JSON = {
    "not json": (b"garbage", "not JSON"),
    "a list": (b"[1, 2]", "the body is a JSON list, not an object"),
    "no images": (_png_body(images=...), "no 'images'"),
    "no prompts, metadata": (_png_body(prompts=..., metadata=...), "no 'prompts', 'metadata'"),
    "images a string": (_png_body(images="x"), "'images' must be a list of str, got str"),
    "prompts null": (_png_body(prompts=None), "'prompts' must be a list of str, got NoneType"),
    "metadata of strings": (_png_body(metadata=["a", "b"]), "'metadata' must be a list of dict"),
    "channels 2": (_png_body(channels=2), "'channels' is 2, not 1 or 3"),
    "an image not base64": (_png_body(images=["%%%", "%%%"]), "images[0] is not a base64 PNG"),
    "an image not a PNG": (_png_body(images=["aGVsbG8=", "aGVsbG8="]), "images[0] is not a base64 PNG"),
    "no images at all": (_png_body(images=[], prompts=[], metadata=[]), "'images' is empty"),
    "a JPEG for a PNG": (_png_body(images=[_jpeg_base64()] * 2), "images[0] is not a base64 PNG (a JPEG image"),
    "nested 100000 deep": (b'{"images": ' + b"[" * 100000 + b"]" * 100000 + b"}", "not JSON (maximum recursion"),
    # A field the server does not read was dropped unseen.
    "an unknown field": (_png_body(audio="x"), "'audio' is not a field of a request"),
}


@pytest.mark.parametrize("case", list(BAD_JSON))
def test_a_malformed_json_request_names_what_was_wrong_and_the_shape_of_a_request(case):
    body, what = BAD_JSON[case]
    with pytest.raises(ValueError) as info:
        decode_request(body, JSON)
    message = str(info.value)
    assert message.startswith(f"bad JSON/PNG scoring request: {what}"), message
    assert message.endswith('a request is {"images": [base64 PNG, ...], "channels": 1 or 3, "prompts": [str, ...], '
                            '"metadata": [{...}, ...]}'), message
    assert "\n" not in message


def test_a_malformed_safetensors_request_names_what_was_wrong():
    from safetensors.torch import save

    good, _ = encode_request(torch.rand(2, 1, 8, 8), ["a", "b"], [{}, {}])
    assert decode_request(good, SAFETENSORS).prompts == ["a", "b"]
    for body, what in [(b"garbage", "bad safetensors scoring request: "),
                       (save({"pixels": torch.zeros(2, 1, 8, 8)}, metadata={"prompts": "[]", "metadata": "[]"}),
                        "no 'images'"),
                       (save({"images": torch.zeros(2, 1, 8, 8)}), "no 'prompts', 'metadata'"),
                       (save({"images": torch.zeros(2, 1, 8, 8)}, metadata={"prompts": '"ab"', "metadata": "[]"}),
                        "'prompts' must be a list of str, got str"),
                       # A name the server does not read was dropped unseen (a mistyped "video").
                       (save({"images": torch.zeros(2, 1, 8, 8), "video": torch.zeros(2, 1, 3, 8, 8)},
                             metadata={"prompts": '["a", "b"]', "metadata": "[{}, {}]"}),
                        "'video' is not read by the server"),
                       (save({"images": torch.zeros(2, 1, 8, 8)},
                             metadata={"prompts": '["a", "b"]', "metadata": "[{}, {}]", "prompt": "x"}),
                        "'prompt' is not read by the server")]:
        with pytest.raises(ValueError, match="a request is a tensor \"images\" \\[B, C, H, W\\]") as info:
            decode_request(body, SAFETENSORS)
        assert what in str(info.value), info.value


def test_image_size_limits_are_read_from_the_png_header_before_any_pixel_is_decompressed(monkeypatch):
    import rewards.wire as wire

    big = _png_body(images=[_big_png_base64(3000, 2000)] * 2)  # 6 M pixels in a few kB each
    assert len(big) < 60_000
    decompressed = []
    real = wire.png_pixels
    monkeypatch.setattr(wire, "png_pixels", lambda image, channels: decompressed.append(image.size)
                        or real(image, channels))
    with pytest.raises(wire.RequestTooLarge, match=r"images\[0\] are 3000x2000 = 6000000 pixels, over the "
                                                   r"server's --max-image-pixels 4194304"):
        decode_request(big, JSON, max_image_pixels=2048 * 2048)
    # The decoded float32 pixels of all images together stay within what a safetensors body may carry.
    with pytest.raises(wire.RequestTooLarge, match=r"images\[0..1\] decode to 48000000 bytes of float32 pixels, "
                                                   r"over the server's 40000000"):
        decode_request(big, JSON, max_image_pixels=10**7, max_decoded_bytes=40_000_000)
    assert decompressed == [(3000, 2000)]  # the first image only: the second was refused from its header
    assert decode_request(big, JSON).images.shape == (2, 1, 2000, 3000)  # no limits: decoded as before
    with pytest.raises(wire.RequestTooLarge, match=r"images are 8x8 = 64 pixels, over the server's "
                                                   r"--max-image-pixels 63"):
        decode_request(encode_request(torch.rand(2, 1, 8, 8), ["a", "b"], [{}, {}])[0], SAFETENSORS,
                       max_image_pixels=63)


def _post(url: str, body: bytes, content_type: str, path: str = "/score") -> tuple[int, str]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{url}{path}", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_server_answers_an_oversized_or_mistyped_batch_with_a_4xx_naming_it(digit_server):
    from safetensors.torch import save

    header = {"prompts": '["a", "b"]', "metadata": "[{}, {}]"}
    status, text = _post(digit_server.url, _png_body(images=[_big_png_base64(3000, 2000)] * 2), JSON)
    assert status == 413 and "--max-image-pixels 4194304" in text, text
    for tensors, shown in [({"images": torch.ones(2, 1, 8, 8, dtype=torch.uint8)}, "'images' is torch.uint8"),
                           ({"images": torch.zeros(2, 1, 0, 8)}, "with B, H, W >= 1 and C 1 or 3"),
                           ({"images": torch.zeros(2, 4, 8, 8)}, "with B, H, W >= 1 and C 1 or 3"),
                           ({"images": torch.zeros(2, 1, 8, 8), "videos": torch.zeros(2, 1, 3, 8, 8)},
                            "reward 'digit_alignment' scores no videos")]:
        status, text = _post(digit_server.url, save(tensors, metadata=header), SAFETENSORS)
        assert status == 400 and shown in text, (shown, status, text)
    status, text = _post(digit_server.url, save({"images": torch.zeros(2, 1, 8, 8)}, metadata=header), SAFETENSORS)
    assert status == 200 and len(json.loads(text)["scores"]) == 2


@pytest.mark.parametrize("pixels, shown", [(torch.rand(2, 1, 8, 8) * 2 - 1, "got values in [-"),
                                           (torch.full((2, 1, 8, 8), 255.0), "got values in [255, 255]")])
def test_pixels_outside_0_1_are_refused_on_the_wire_and_in_process(digit_server, pixels, shown):
    # A VAE's [-1, 1] output or 8-bit values would be scored without complaint, and wrongly.
    import urllib.error
    import urllib.request

    body, content_type = encode_request(pixels, ["a 3", "a 4"], [{}, {}])
    with pytest.raises(ValueError, match=r"images must hold pixel values in \[0, 1\]") as info:
        decode_request(body, content_type)
    assert shown in str(info.value) and "(x + 1) / 2" in str(info.value)
    request = urllib.request.Request(f"{digit_server.url}/score", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(request, timeout=30)
    assert http.value.code == 400 and b"pixel values in [0, 1]" in http.value.read()
    with pytest.raises(ValueError, match=r"RewardSet.score's images must hold pixel values in \[0, 1\]"):
        RewardSet("digit_alignment").score(pixels, ["a 3", "a 4"], None, weight_version=0)


def test_pixels_in_0_1_with_rounding_and_nan_rows_are_scored():
    pixels = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    pixels[0, 0, 0, 0], pixels[1, 0, 0, 0] = 1 + 5e-5, -5e-5  # a client's rounding, within the slack
    pixels[2] = float("nan")  # a broken sample: masked, not refused
    body, content_type = encode_request(pixels, ["a 3", "a 4", "a 5"], [{}, {}, {}])
    assert decode_request(body, content_type).images.shape == (3, 1, 8, 8)
    batch = RewardSet("digit_alignment").score(pixels, ["a 3", "a 4", "a 5"], None, weight_version=0)
    assert batch.valid.tolist() == [True, True, False]
    pixels[0, 0, 0, 0] = 1.001  # past the slack
    with pytest.raises(ValueError, match=r"got values in \[-5e-05, 1\.001\]"):
        decode_request(encode_request(pixels, ["a 3", "a 4", "a 5"], [{}, {}, {}])[0], content_type)


def test_health_answers_while_a_batch_is_being_decoded_and_a_deep_body_is_still_a_400(monkeypatch):
    """Decoding runs off the event loop: a large batch being decoded used to hold up /health."""
    import threading
    import urllib.request

    import rewards.serve as serve

    started, release = threading.Event(), threading.Event()
    real = serve.decode_request

    def slow_decode(*args):
        started.set()
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(serve, "decode_request", slow_decode)
    with ServerThread(rewards.get("digit_alignment"), "digit_alignment") as server:
        body, content_type = encode_request(_images(), PROMPTS, [{}] * 6)
        scoring = threading.Thread(target=_post, args=(server.url, body, content_type), daemon=True)
        scoring.start()
        assert started.wait(10)
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as reply:
                health = reply.status
        finally:
            release.set()
        scoring.join(10)
        deep = b'{"images": ' + b"[" * 100000 + b"]" * 100000 + b"}"
        status, text = _post(server.url, deep, JSON)
    assert health == 200
    assert status == 400 and "maximum recursion" in text, text


@pytest.mark.parametrize("body, status, shown", [
    (b"{not json", 400, "bad coverage request: not JSON"),
    (b"[1, 2]", 400, 'a request is {"prompts": [str, ...], "metadata": [object, ...]}'),
    (json.dumps({"prompts": ["a", "b"], "metadata": [{}]}).encode(), 400, "2 prompts but 1 metadata objects"),
    (json.dumps({"prompts": [1], "metadata": [{}]}).encode(), 400, "'prompts' must be a list of str"),
    (json.dumps({"prompts": ["x"], "metadata": [{"digit": 12}]}).encode(), 400, "is out of range"),
    (json.dumps({"prompts": ["x"], "metadata": [{}], "zzz": 1}).encode(), 400, "'zzz' is not a field"),
    (json.dumps({"prompts": ["a 7", "a cat"], "metadata": [{}, {}]}).encode(), 200, '"scored": [true, false]'),
])
def test_coverage_answers_which_prompts_are_scored_and_names_a_bad_request(digit_server, body, status, shown):
    got, text = _post(digit_server.url, body, JSON, path="/coverage")
    reply = json.loads(text)
    assert (got, shown in (reply["error"] if status != 200 else text)) == (status, True), text


def test_coverage_needs_the_token_and_a_reward_that_says(digit_server):
    with ServerThread(rewards.get("digit_alignment"), "digit_alignment", token="s3cret") as server:
        got, text = _post(server.url, b'{"prompts": [], "metadata": []}', JSON, path="/coverage")
        assert got == 401
    with ServerThread(rewards.get("jpeg_compressibility"), "jpeg_compressibility") as server:
        got, text = _post(server.url, b'{"prompts": ["a"], "metadata": [{}]}', JSON, path="/coverage")
        assert got == 404 and "does not say which prompts it scores" in text
        assert RemoteScorer(server.url).prompt_needs is None


def test_a_client_refuses_a_coverage_reply_of_the_wrong_shape():
    from rewards.wire import decode_coverage

    assert decode_coverage(b'{"scored": [true, false]}', 2) == [True, False]
    for reply, shown in [(b'{"scored": [true]}', "for 1 rows of 2"), (b'{"scored": [1, 0]}', "true/false"),
                         (b"nope", "not JSON")]:
        with pytest.raises(ValueError, match=shown):
            decode_coverage(reply, 2)


def test_a_row_the_scorer_refuses_is_the_clients_error_not_the_servers(digit_server):
    from safetensors.torch import save

    header = {"prompts": '["x"]', "metadata": '[{"digit": 42}]'}
    status, text = _post(digit_server.url, save({"images": torch.zeros(1, 1, 8, 8)}, metadata=header), SAFETENSORS)
    assert status == 400, text  # a 500 reads as the scorer failing: the client masks and goes on
    assert "reward 'digit_alignment' refused the batch" in json.loads(text)["error"] and "out of range" in text


def test_an_empty_token_is_refused_by_both_servers():
    from engine.serve import build_app
    from rewards.serve import make_app

    with pytest.raises(ValueError, match="token is empty"):
        make_app(rewards.get("jpeg_compressibility"), "jpeg_compressibility", token="")
    with pytest.raises(ValueError, match="token is empty"):
        build_app(None, token=" ")
    for module in ("rewards.serve", "engine.serve"):
        argv = ["--reward", "jpeg_compressibility"] if module == "rewards.serve" else []
        done = subprocess.run([sys.executable, "-m", module, *argv, "--token", ""], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 2 and "--token: the token is empty" in done.stderr, (module, done.stderr[-800:])


def test_a_wrong_path_or_method_is_a_json_error(digit_server):
    import urllib.error
    import urllib.request

    for method, path, status, shown in (("GET", "/nope", 404, "GET /nope: no such route; the routes: GET /health"),
                                        ("GET", "/score", 405, "GET /score: not allowed; this route takes POST")):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(digit_server.url + path, method=method), timeout=30)
        assert err.value.code == status
        assert shown in json.loads(err.value.read())["error"]
