"""`remote:<url>`: a scorer that sends batches to a reward server (`python -m rewards.serve`).

Checks /health when built, then POSTs each batch. Every bound is wall clock:
`timeout_s` bounds one HTTP call from connect to the last byte of the reply
(a server that trickles bytes cannot stretch it), and `budget_s` bounds all
attempts of one scoring call together, backoff included. Connection failures,
timeouts and "503 busy" are retried with exponential backoff while the budget
lasts; then `RemoteRewardError` names the address and the budget (the
RewardSet masks the batch and records the error). Other HTTP errors are not
retried: a scorer error (500) or a refused request (4xx) would fail again.
A reply must be at most `max_reply_bytes` and hold one number (or null) per
image; anything else is a `RemoteRewardError` naming what came back.

The server's /health says whether its reward needs audio or whole videos; the
client then declares the same (`wants_audio`, `wants_video`), so a RewardSet
hands it those inputs and it sends them (safetensors only). A server that does
not say is an image reward.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
from urllib.parse import urlsplit

import torch

from rewards.wire import decode_coverage, decode_scores, encode_coverage_request, encode_request

PREFIX = "remote:"
TOKEN_ENV = "FLYWHEEL_REWARD_TOKEN"
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_BUDGET_S = 120.0
DEFAULT_MAX_REPLY_BYTES = 16 * 1024**2  # a JSON list of ~1M scores; a reply is a few bytes per image
RETRY_STATUSES = (503,)  # the server is full right now (rewards.serve's body-memory bound); later may work


class RemoteRewardError(RuntimeError):
    """The reward server at an address could not be reached, refused a batch or answered nonsense."""


class _Retryable(Exception):
    """One attempt failed in a way a later attempt may not (connection, timeout, 503)."""


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


# A socket's timeout must fit the platform's time_t (1e30 raises OverflowError at the first call, long after the
# setting was taken); a week is far over any reward call.
MAX_SECONDS = 604_800


def check_seconds(name: str, value: object) -> float:
    """A finite number of seconds in (0, MAX_SECONDS]; ValueError naming the setting otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
        raise ValueError(f"{name} must be a number of seconds in (0, {MAX_SECONDS}] (a week), got {value!r}")
    return float(value)


class RemoteScorer:
    """Scorer client for a reward server; called like any in-process scorer."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 budget_s: float = DEFAULT_BUDGET_S, retries: int = 3, backoff_s: float = 0.5,
                 encoding: str = "safetensors", health_timeout_s: float = 5.0,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES):
        """`timeout_s`: wall-clock bound of one HTTP call; `budget_s`: of one scoring call, retries and
        backoff included; `encoding`: "safetensors" (exact float32 images) or "png" (uint8, smaller);
        token defaults to $FLYWHEEL_REWARD_TOKEN."""
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        self.budget_s = check_seconds("budget_s", budget_s)
        self.health_timeout_s = check_seconds("health_timeout_s", health_timeout_s)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
        if not (isinstance(backoff_s, (int, float)) and 0 <= backoff_s < math.inf):
            raise ValueError(f"backoff_s must be a finite number of seconds >= 0, got {backoff_s!r}")
        if isinstance(max_reply_bytes, bool) or not isinstance(max_reply_bytes, int) or max_reply_bytes < 1:
            raise ValueError(f"max_reply_bytes must be a positive integer, got {max_reply_bytes!r}")
        self.url = check_url(url)
        self.name = PREFIX + self.url
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.retries, self.backoff_s, self.encoding = retries, float(backoff_s), encoding
        self.max_reply_bytes = max_reply_bytes
        encode_request(torch.zeros(1, 1, 1, 1), [""], [{}], encoding)  # fail now on a bad encoding name
        reply = self._call("GET", "/health", None, None, self.health_timeout_s)
        try:
            health = json.loads(reply)
        except ValueError:
            health = None
        if not isinstance(health, dict) or health.get("status") != "ok":
            raise RemoteRewardError(f"reward server at {self.url} is not healthy: {reply[:200]!r}")
        self.served_reward: str = str(health.get("reward", "?"))
        # What a prompt needs for the served reward to score it, when the reward says (POST /coverage answers
        # then); None from a reward that does not, or from a server older than /coverage.
        needs = health.get("prompt_needs")
        self.prompt_needs: str | None = needs if isinstance(needs, str) else None
        self.wants_audio = health.get("wants_audio") is True
        self.wants_video = health.get("wants_video") is True
        if (self.wants_audio or self.wants_video) and encoding != "safetensors":
            raise ValueError(f"reward server at {self.url} serves {self.served_reward!r}, which needs "
                             f"{'audio' if self.wants_audio else 'videos'}; these travel only with "
                             f"encoding='safetensors', not {encoding!r}")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], *,
                 audio: torch.Tensor | None = None, sample_rate: int | None = None,
                 videos: torch.Tensor | None = None) -> torch.Tensor:
        """Raw scores [B] float32 on the host, computed by the server (audio and videos sent when given)."""
        body, content_type = encode_request(images, prompts, metadata, self.encoding, audio=audio,
                                            sample_rate=sample_rate, videos=videos)
        reply = self._call("POST", "/score", body, content_type, self.timeout_s)
        try:
            return decode_scores(reply, len(prompts))
        except ValueError as exc:  # the server answered, but not with scores: retrying will not help
            raise RemoteRewardError(f"reward server at {self.url} answered POST /score with a bad reply: "
                                    f"{exc}") from None

    def scored_rows(self, prompts: list[str], metadata: list[dict]) -> list[bool] | None:
        """Which of these rows the served reward can score (POST /coverage), or None when it does not say
        (`prompt_needs` is None). RemoteRewardError when the server does not answer, or answers badly."""
        if self.prompt_needs is None:
            return None
        reply = self._call("POST", "/coverage", encode_coverage_request(prompts, metadata), "application/json",
                           self.timeout_s)
        try:
            return decode_coverage(reply, len(prompts))
        except ValueError as exc:
            raise RemoteRewardError(f"reward server at {self.url} answered POST /coverage with a bad reply: "
                                    f"{exc}") from None

    def _call(self, method: str, path: str, body: bytes | None, content_type: str | None,
              timeout_s: float) -> bytes:
        """The reply body of one request, retried within the budget; RemoteRewardError naming the address."""
        headers = {"Content-Type": content_type} if content_type else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + self.budget_s
        last, attempts = "no attempt made", 0
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                if time.monotonic() + pause >= deadline:
                    break  # no time left for another attempt after the backoff
                time.sleep(pause)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            attempts += 1
            try:
                return self._exchange(method, path, body, headers, min(timeout_s, left))
            except _Retryable as exc:
                last = str(exc)
        spent = self.budget_s - max(deadline - time.monotonic(), 0.0)
        raise RemoteRewardError(f"reward server at {self.url} did not answer {method} {path}: {attempts} "
                                f"attempt{'s' if attempts != 1 else ''} in {spent:.1f} s (budget_s={self.budget_s:g}, "
                                f"timeout_s={timeout_s:g} per call, retries={self.retries}); last error: {last}")

    def _exchange(self, method: str, path: str, body: bytes | None, headers: dict, timeout_s: float) -> bytes:
        """One HTTP request and its reply, all within `timeout_s` of wall clock.

        A socket timeout bounds each read, not the call: a server sending a byte
        a second never trips it. So a timer shuts the socket down at the deadline,
        which wakes whatever send or receive is blocked.
        """
        parts = urlsplit(self.url)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname, parts.port, timeout=timeout_s)
        expired, sockets = threading.Event(), []

        def cut() -> None:
            expired.set()
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed

        timer = threading.Timer(timeout_s, cut)
        timer.daemon = True
        timer.start()
        try:
            connection.connect()
            # Kept here: http.client drops connection.sock when a reply says "Connection: close",
            # and the reply is then read through the same socket.
            sockets.append(connection.sock)
            if expired.is_set():  # connected just as the timer fired: it had no socket to cut
                raise TimeoutError
            connection.request(method, parts.path + path, body=body, headers=headers)
            response = connection.getresponse()
            reply = self._read_reply(response, method, path)
            if expired.is_set():  # the cut socket reads as a clean end of the reply
                raise TimeoutError
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set() or isinstance(exc, TimeoutError):  # the timer or the socket's own timeout
                raise _Retryable(f"no complete reply within timeout_s={timeout_s:.3g} s") from None
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        finally:
            timer.cancel()
            connection.close()
        if response.status in RETRY_STATUSES:
            raise _Retryable(f"HTTP {response.status}: {reply[:300].decode(errors='replace')}")
        if response.status >= 400:  # the server answered: asking again will not change its mind
            raise RemoteRewardError(f"reward server at {self.url} answered {method} {path} with HTTP "
                                    f"{response.status}: {reply[:500].decode(errors='replace')}")
        return reply

    def _read_reply(self, response: http.client.HTTPResponse, method: str, path: str) -> bytes:
        """The reply body, refused as soon as it is known to exceed max_reply_bytes."""
        limit = self.max_reply_bytes
        if response.length is not None and response.length > limit:
            raise RemoteRewardError(f"reward server at {self.url} sent a {response.length}-byte reply to "
                                    f"{method} {path}; max_reply_bytes={limit}")
        chunks, size = [], 0
        while chunk := response.read(min(65536, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise RemoteRewardError(f"reward server at {self.url} sent more than max_reply_bytes={limit} "
                                        f"in its reply to {method} {path}")
        return b"".join(chunks)
