"""`remote:<url>`: a scorer that sends batches to a reward server (`python -m rewards.serve`).

Checks /health when built, then POSTs each batch with a per-call timeout and
a bounded number of retries with exponential backoff on connection failures
and timeouts; after that it raises `RemoteRewardError` naming the address (the
RewardSet then masks the batch and records the error). A server-side scorer
error (HTTP 500) is not retried: it would fail again.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import torch

from rewards.wire import decode_scores, encode_request

PREFIX = "remote:"
TOKEN_ENV = "FLYWHEEL_REWARD_TOKEN"


class RemoteRewardError(RuntimeError):
    """The reward server at an address could not be reached or refused a batch."""


def check_url(url: str) -> str:
    """`url` without a trailing slash, if it is http(s)://host[:port][/path]; a clear error otherwise."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018  (raises on a malformed port)
    except ValueError:
        raise ValueError(f"remote reward address {url!r} has a malformed port; expected e.g. "
                         "http://127.0.0.1:8100") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"remote reward address {url!r} is not valid; expected http(s)://host:port, "
                         "e.g. remote:http://127.0.0.1:8100")
    return url.rstrip("/")


class RemoteScorer:
    """Scorer client for a reward server; called like any in-process scorer."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, encoding: str = "safetensors", health_timeout_s: float = 5.0):
        """`encoding`: "safetensors" (exact float32 images) or "png" (uint8, smaller); token defaults to
        $FLYWHEEL_REWARD_TOKEN."""
        if retries < 0 or timeout_s <= 0:
            raise ValueError(f"retries must be >= 0 and timeout_s > 0, got retries={retries}, timeout_s={timeout_s}")
        self.url = check_url(url)
        self.name = PREFIX + self.url
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.timeout_s, self.retries, self.backoff_s, self.encoding = timeout_s, retries, backoff_s, encoding
        encode_request(torch.zeros(1, 1, 1, 1), [""], [{}], encoding)  # fail now on a bad encoding name
        health = json.loads(self._call("GET", "/health", None, None, health_timeout_s))
        if health.get("status") != "ok":
            raise RemoteRewardError(f"reward server at {self.url} is not healthy: {health}")
        self.served_reward: str = health.get("reward", "?")

    def _call(self, method: str, path: str, body: bytes | None, content_type: str | None, timeout_s: float) -> bytes:
        """One HTTP call with bounded retries; RemoteRewardError naming the address when it cannot succeed."""
        headers = {"Content-Type": content_type} if content_type else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    return response.read()
            except urllib.error.HTTPError as exc:  # the server answered: retrying will not help
                detail = exc.read().decode(errors="replace")[:500]
                raise RemoteRewardError(f"reward server at {self.url} answered {method} {path} with HTTP "
                                        f"{exc.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        raise RemoteRewardError(f"reward server at {self.url} unreachable: {method} {path} failed "
                                f"{self.retries + 1} times (timeout {timeout_s:g} s each); last error {last}")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Raw scores [B] float32 on the host, computed by the server."""
        body, content_type = encode_request(images, prompts, metadata, self.encoding)
        return decode_scores(self._call("POST", "/score", body, content_type, self.timeout_s), len(prompts))
