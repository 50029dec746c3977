"""Serve one reward over HTTP: `python -m rewards.serve --reward ocr [--port 8100]`.

Endpoints: GET /health -> {"status": "ok", "reward": name, "wants_audio": bool,
"wants_video": bool, "prompt_needs": str | null} (what the client must send; see
rewards.types); POST /score with a safetensors or JSON/PNG body (see rewards.wire)
-> {"scores": [...]}; a batch without the audio or videos the reward needs is
refused (400); POST /coverage {"prompts": [...], "metadata": [...]} -> {"scored":
[bool, ...]}, which prompts the reward can score, for a reward that says
(prompt_needs not null: the digit, number and OCR rewards; 404 otherwise). Binds
127.0.0.1 unless --host says otherwise; with a token ($FLYWHEEL_REWARD_TOKEN or
--token) every request must carry `Authorization: Bearer <token>`, and binding
another address without one logs a warning. Scoring runs on a worker thread,
one batch at a time, so the event loop keeps answering health checks.

Limits, so that slow or many clients cannot exhaust the server: one body is at
most `max_body_bytes` (413), an image or video frame at most `max_image_pixels`
(413, read from a PNG's header before it is decompressed); the bodies of all requests being read, decoded or
waiting for the scorer together at most `max_inflight_bytes` (503 while full:
the client retries later); a connection must deliver its request headers within
`header_timeout_s` (closed otherwise) and its body within `body_timeout_s` (408).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import threading

from aiohttp import web

from engine.http_limits import (InflightBudget, LimitExceeded, ServerLimits, add_limit_args, read_body,
                                warn_if_exposed)
from engine.server_flags import FlagParser, check_limits_and_address, check_positive, flag_error
from rewards.registry import REMOTE, available, check_scorer, get, import_modules, scorer_parameters
from rewards.remote import TOKEN_ENV
from rewards.types import Scorer, scorer_inputs, wants_audio, wants_video
from rewards.wire import RequestTooLarge, decode_coverage_request, decode_request, encode_scores

logger = logging.getLogger(__name__)
MAX_BODY = 1024**3  # 1 GiB: a large batch of float32 images fits
MAX_INFLIGHT = 2 * MAX_BODY  # one big batch being scored and the next one arriving
HEADER_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 120.0  # 1 GiB at ~70 Mbit/s
# An image or video frame: the engine server's limit on its conditioning images (2048 x 2048). A scorer's
# working memory grows with the pixels it is given, and a 300 kB PNG can hold 9000 x 9000 of them.
MAX_IMAGE_PIXELS = 2048 * 2048


def make_app(scorer: Scorer, name: str, token: str | None = None, max_body_bytes: int = MAX_BODY,
             max_inflight_bytes: int = MAX_INFLIGHT, header_timeout_s: float = HEADER_TIMEOUT_S,
             body_timeout_s: float = BODY_TIMEOUT_S, max_image_pixels: int = MAX_IMAGE_PIXELS) -> web.Application:
    """The aiohttp application serving `scorer` under the reward name `name` (limits: see engine.http_limits;
    `max_image_pixels` bounds each image and video frame, 413 above, and PNG images may decode to at most
    `max_body_bytes` of float32, what a safetensors body may carry)."""
    if isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int) or max_image_pixels < 1:
        raise ValueError(f"max_image_pixels must be an int >= 1, got {max_image_pixels!r}")
    if token is not None and not token.strip():
        raise ValueError("token is empty: give a non-empty token, or None to serve without one")
    limits = ServerLimits(max_body_bytes, max_inflight_bytes, header_timeout_s, body_timeout_s)
    lock = asyncio.Lock()
    inflight = InflightBudget(limits)

    @web.middleware
    async def auth(request: web.Request, handler):
        if token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:  # aiohttp's plain-text pages: JSON like every other error
            return web.json_response({"error": f"{request.method} {request.path}: not allowed; this route takes "
                                               f"{', '.join(sorted(exc.allowed_methods))}"}, status=405)
        except web.HTTPNotFound:
            return web.json_response({"error": f"{request.method} {request.path}: no such route; the routes: "
                                               "GET /health, POST /score, POST /coverage"}, status=404)

    # The scorer's own word on which prompts it can score (the digit, number and OCR rewards say), so that a
    # client checks its datasets before a run, as it does for an in-process scorer; None: it does not say.
    scored_rows = getattr(scorer, "scored_rows", None)
    prompt_needs = (getattr(scorer, "prompt_needs", None) or "a target it reads") if callable(scored_rows) else None

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": name, "wants_audio": wants_audio(scorer),
                                  "wants_video": wants_video(scorer), "prompt_needs": prompt_needs})

    async def coverage(request: web.Request) -> web.Response:
        if prompt_needs is None:
            return web.json_response({"error": f"reward {name!r} does not say which prompts it scores (its "
                                               "/health has prompt_needs null)"}, status=404)
        try:
            with inflight.reserve(request):
                body = await read_body(request, limits)
                prompts, metadata = decode_coverage_request(body)
                scored = await asyncio.to_thread(scored_rows, prompts, metadata)
        except LimitExceeded as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        except ValueError as exc:  # a malformed body, or a row the scorer refuses (a digit out of range)
            return web.json_response({"error": str(exc)}, status=400)
        except Exception as exc:  # the scorer's own failure, told to the client
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        return web.json_response({"scored": [bool(ok) for ok in scored], "prompt_needs": prompt_needs})

    async def score(request: web.Request) -> web.Response:
        # The bytes stay reserved until the answer: the decoded batch waiting for the scorer is
        # memory the body turned into.
        try:
            with inflight.reserve(request):
                return await _score(request)
        except LimitExceeded as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)

    async def _score(request: web.Request) -> web.Response:
        body = await read_body(request, limits)
        try:
            # Off the event loop: decoding a large batch would hold up /health and the other requests.
            batch = await asyncio.to_thread(decode_request, body, request.content_type, max_image_pixels,
                                            max_body_bytes)
            extra = scorer_inputs(name, scorer, batch.images, batch.audio, batch.sample_rate, batch.videos)
            unused = [key for key in ("audio", "videos") if getattr(batch, key) is not None and key not in extra]
            if unused:  # scored without them, the client would believe they counted
                raise ValueError(f"reward {name!r} scores no {' or '.join(unused)} (its /health says wants_audio "
                                 f"{wants_audio(scorer)}, wants_video {wants_video(scorer)}); send the images alone")
        except RequestTooLarge as exc:
            return web.json_response({"error": str(exc)}, status=413)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        del body  # the decoded tensors are what the rest of the request holds
        async with lock:  # one batch at a time: scorers need not be thread-safe
            try:
                scores = await asyncio.to_thread(scorer, batch.images, batch.prompts, batch.metadata, **extra)
            except ValueError as exc:  # the scorer refuses a row it was sent (a digit out of range): the client's
                logger.warning("reward %r refused a batch of %d: %s", name, len(batch.prompts), exc)
                return web.json_response({"error": f"reward {name!r} refused the batch: {exc}"}, status=400)
            except Exception as exc:  # reported to the client, which masks the rows
                logger.warning("reward %r failed on a batch of %d: %s", name, len(batch.prompts), exc)
                return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        return web.Response(body=encode_scores(scores), content_type="application/json")

    app = web.Application(middlewares=[auth], **limits.app_kwargs())
    app.router.add_get("/health", health)
    app.router.add_post("/score", score)
    app.router.add_post("/coverage", coverage)
    return app


class ServerThread:
    """A reward server on a background thread (tests, benchmarks, notebooks); `stop()` ends it."""

    def __init__(self, scorer: Scorer, name: str, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 **limits):
        """`limits`: max_body_bytes, max_inflight_bytes, header_timeout_s, body_timeout_s, max_image_pixels
        (see make_app)."""
        app = make_app(scorer, name, token, **limits)
        warn_if_exposed(host, token, f"reward server for {name!r}", f"--token or ${TOKEN_ENV}")
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, access_log=None)
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, host, port)
                self._loop.run_until_complete(site.start())
                self.port = self._runner.addresses[0][1]  # the real port when asked for port 0
            except BaseException as exc:  # reported to the constructor's caller
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self.host = host
        self._thread = threading.Thread(target=run, name=f"reward-server-{name}", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise RuntimeError(f"reward server for {name!r} could not bind {host}:{port}: {failure[0]}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """Close the listening socket and the loop; idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def check_flags(args: argparse.Namespace) -> tuple[ServerLimits, dict]:
    """(limits, the scorer's kwargs) from `main`'s flags, each checked before the scorer loads; a bad one exits 2
    with one `error:` line naming it (engine/server_flags.py)."""
    if args.reward.startswith(REMOTE) or args.reward not in available():
        flag_error(f"--reward {args.reward}: unknown scorer; known scorers: {', '.join(available())}")
    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as e:
        flag_error(f"--kwargs {args.kwargs}: not JSON ({e})")
    if not isinstance(kwargs, dict):
        flag_error(f"--kwargs {args.kwargs}: must be a JSON object of the scorer's arguments, e.g. "
                   '\'{"path": "/models/clip"}\'')
    params, takes_any = scorer_parameters(args.reward)
    unknown = sorted(a for a in kwargs if a not in params)
    if unknown and not takes_any:  # else the scorer's constructor raises a TypeError traceback once it loads
        flag_error(f"--kwargs {args.kwargs}: scorer {args.reward!r} takes no argument {unknown[0]!r}; valid "
                   f"arguments: {', '.join(params) or '(none)'}")
    try:
        check_scorer(args.reward, **kwargs)
    except (ValueError, OSError) as e:
        flag_error(f"--reward {args.reward} --kwargs {args.kwargs}: {e}")
    check_positive(args.max_image_pixels, "--max-image-pixels")
    limits = check_limits_and_address(args)
    return limits, kwargs


def main(argv: list[str] | None = None) -> None:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", required=True,
                        help="scorer name, e.g. ocr: a built-in, one an installed package declares under the "
                             "entry-point group flywheel.rewards, or one a --module registers")
    parser.add_argument("--module", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (it registers scorers with rewards.registry.register); repeatable")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8100, help="port (0: any free port, printed at start)")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV) or None,
                        help=f"require 'Authorization: Bearer TOKEN' on every request (default: ${TOKEN_ENV}, "
                             "which keeps the token out of the process list)")
    parser.add_argument("--kwargs", default="{}", help='JSON kwargs for the scorer, e.g. \'{"path": "/models/clip"}\'')
    add_limit_args(parser, ServerLimits(MAX_BODY, MAX_INFLIGHT, HEADER_TIMEOUT_S, BODY_TIMEOUT_S))
    parser.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                        help=f"largest image or video frame, in pixels (413 above; default {MAX_IMAGE_PIXELS}, "
                             "2048 x 2048)")
    args = parser.parse_args(argv)
    try:
        import_modules(args.module, key="--module")  # before the checks: a module's scorers become known names
    except ImportError as exc:
        flag_error(str(exc))  # one line and exit 2, like any other bad flag
    limits, kwargs = check_flags(args)  # every flag checked before the scorer loads
    logging.basicConfig(level=logging.INFO)
    scorer = get(args.reward, **kwargs)
    server = ServerThread(scorer, args.reward, args.host, args.port, args.token, **limits.as_kwargs(),
                          max_image_pixels=args.max_image_pixels)
    print(f"serving reward {args.reward!r} at {server.url}", flush=True)
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
