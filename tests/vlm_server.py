"""A local OpenAI-compatible chat-completions server for the vlm_judge tests, on 127.0.0.1 (aiohttp, a thread).

It "sees" like a VLM judge of the toy digits: it decodes each data-URL image,
reads the quoted prompt's digit, and takes p = the shipped digit CNN's
probability of that digit (the mean over the images of a request, e.g. video
frames). It answers in the format each mode of rewards.vlm_judge reads:
- logprobs=true: one token whose top_logprobs give "Yes" 0.7·p, " yes" 0.3·p
  (case variants the client must fold), "No" 1 - p, and filler tokens;
- otherwise a rubric reply ending "Final Score: 1 + 4p", or {"score": 10p} when
  the text asks for JSON.
`behaviour` switches failures on for the robustness tests: "garbage" replies,
"error" (HTTP 500), "slow" (sleeps `delay_s`), or "down" (refuses connections).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import re
import threading
import time

import numpy as np
import torch
from aiohttp import web
from PIL import Image

from rewards.digits import DigitAlignment, prompted_digits

MODEL = "toy-vlm"
QUOTED = re.compile(r'"([^"]*)"')


def decode(url: str) -> torch.Tensor:
    """A PNG data URL -> image [3, H, W] float in [0, 1]."""
    head, _, payload = url.partition(",")
    assert head == "data:image/png;base64", head
    rgb = np.asarray(Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB"), dtype=np.float32) / 255
    return torch.from_numpy(rgb).permute(2, 0, 1)


class JudgeServer:
    """Start with `with JudgeServer() as server:`; `server.base_url` is the OpenAI base URL (…/v1)."""

    def __init__(self, api_key: str | None = None):
        self.api_key, self.behaviour, self.delay_s = api_key, "ok", 0.0
        self.requests: list[dict] = []
        self.cnn = DigitAlignment()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def prob(self, body: dict) -> float:
        content = body["messages"][-1]["content"]
        text = " ".join(part["text"] for part in content if part["type"] == "text")
        images = torch.stack([decode(part["image_url"]["url"]) for part in content if part["type"] == "image_url"])
        prompt = QUOTED.search(text).group(1)
        digit = prompted_digits([prompt], [{}])[0]
        return float(self.cnn.probs(images)[:, digit].mean())

    async def completions(self, request: web.Request) -> web.Response:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        self.requests.append(body)
        if self.behaviour == "slow":
            await asyncio.sleep(self.delay_s)
        if self.behaviour == "error":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        p = min(max(self.prob(body), 1e-6), 1 - 1e-6)
        logprobs = None
        if self.behaviour == "garbage":
            text = "I cannot tell."
            if body.get("logprobs"):
                logprobs = {"content": [{"token": "I", "logprob": -0.1, "bytes": None,
                                         "top_logprobs": [{"token": "I", "logprob": -0.1, "bytes": None}]}]}
        elif body.get("logprobs"):
            top = [("Yes", math.log(0.7 * p)), (" yes", math.log(0.3 * p)), ("No", math.log(1 - p))]
            top += [(f"tok{i}", -30.0 - i) for i in range(int(body.get("top_logprobs", 5)) - len(top))]
            top.sort(key=lambda t: -t[1])
            logprobs = {"content": [{"token": top[0][0], "logprob": top[0][1], "bytes": None,
                                     "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in top]}]}
            text = top[0][0]
        elif "JSON" in body["messages"][-1]["content"][-1]["text"]:
            text = json.dumps({"score": round(10 * p, 4)})
        else:
            text = f"The digit is drawn fairly well.\nFinal Score: {1 + 4 * p:.4f}"
        return web.json_response({
            "id": f"cmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", MODEL),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                              "owned_by": "test"}]})

    async def _start(self, port: int = 0) -> None:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        await self._runner.cleanup()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        """Close the listening socket: later calls are refused (a judge server that went away)."""
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)

    def restart(self) -> None:
        """Listen again on the same port (the judge server is back)."""
        asyncio.run_coroutine_threadsafe(self._start(self.port), self._loop).result(10)

    def __enter__(self) -> "JudgeServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        except Exception:
            pass  # already stopped by the test
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
