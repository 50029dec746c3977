"""Serve one reward over HTTP: `python -m rewards.serve --reward ocr [--port 8100] [--token T]`.

Endpoints: GET /health -> {"status": "ok", "reward": name}; POST /score with a
safetensors or JSON/PNG body (see rewards.wire) -> {"scores": [...]}. Binds
127.0.0.1 unless --host says otherwise; with a token every request must carry
`Authorization: Bearer <token>`. Scoring runs on a worker thread, one batch at
a time, so the event loop keeps answering health checks.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import threading

from aiohttp import web

from rewards.registry import get
from rewards.types import Scorer
from rewards.wire import decode_request, encode_scores

logger = logging.getLogger(__name__)
MAX_BODY = 1024**3  # 1 GiB: a large batch of float32 images fits


def make_app(scorer: Scorer, name: str, token: str | None = None) -> web.Application:
    """The aiohttp application serving `scorer` under the reward name `name`."""
    lock = asyncio.Lock()

    @web.middleware
    async def auth(request: web.Request, handler):
        if token is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": name})

    async def score(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            images, prompts, metadata = decode_request(body, request.content_type)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        async with lock:  # one batch at a time: scorers need not be thread-safe
            try:
                scores = await asyncio.to_thread(scorer, images, prompts, metadata)
            except Exception as exc:  # reported to the client, which masks the rows
                logger.warning("reward %r failed on a batch of %d: %s", name, len(prompts), exc)
                return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        return web.Response(body=encode_scores(scores), content_type="application/json")

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY)
    app.router.add_get("/health", health)
    app.router.add_post("/score", score)
    return app


class ServerThread:
    """A reward server on a background thread (tests, benchmarks, notebooks); `stop()` ends it."""

    def __init__(self, scorer: Scorer, name: str, host: str = "127.0.0.1", port: int = 0, token: str | None = None):
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(make_app(scorer, name, token), access_log=None)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", required=True, help="registered scorer name, e.g. ocr")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8100, help="port (0: any free port, printed at start)")
    parser.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' on every request")
    parser.add_argument("--kwargs", default="{}", help='JSON kwargs for the scorer, e.g. \'{"path": "/models/clip"}\'')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    scorer = get(args.reward, **json.loads(args.kwargs))
    server = ServerThread(scorer, args.reward, args.host, args.port, args.token)
    print(f"serving reward {args.reward!r} at {server.url}", flush=True)
    try:
        server._thread.join()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
