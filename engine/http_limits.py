"""Limits shared by the aiohttp servers (`engine.serve`, `rewards.serve`), so slow or many clients cannot exhaust them.

- `ServerLimits`: one body at most `max_body_bytes` (413); the bodies all clients hold at once at most
  `max_inflight_bytes` (503 while full: retry later); request headers within `header_timeout_s` (the
  connection is closed) and a body within `body_timeout_s` (408). `app_kwargs()` sets the first and the
  third on a `web.Application`; `InflightBudget` and `read_body` enforce the rest.
- `LimitExceeded` carries the status and message; each server answers it in its own response format.
- `add_limit_args` / `from_args`: the same four command-line flags for every server.
- `warn_if_exposed`: a warning when a server without a token binds an address other machines reach.

Each server decides how long a request's bytes stay reserved (`with budget.reserve(request): ...`):
the engine server only while receiving the body, the reward server until it has answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from aiohttp import web

logger = logging.getLogger(__name__)
# After a 408/413 the unread rest of a body is drained this long, so the client can read the answer
# instead of a reset, but a slow client is not kept for aiohttp's default 10 s.
LINGERING_TIME_S = 2.0


class LimitExceeded(Exception):
    """A request refused by a limit; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServerLimits:
    """The four numbers that bound what clients can make a server hold; checked on construction."""

    max_body_bytes: int
    max_inflight_bytes: int
    header_timeout_s: float
    body_timeout_s: float

    def __post_init__(self) -> None:
        if not 0 < self.max_body_bytes <= self.max_inflight_bytes:
            raise ValueError(f"need 0 < max_body_bytes <= max_inflight_bytes, got {self.max_body_bytes} and "
                             f"{self.max_inflight_bytes}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")

    def app_kwargs(self) -> dict:
        """`web.Application` arguments: the per-body size limit and the header timeout.

        aiohttp's keepalive timer also runs from the moment a connection opens, so it closes a
        connection that has not sent complete request headers by then: it is the header bound.
        """
        return {"client_max_size": self.max_body_bytes,
                "handler_args": {"keepalive_timeout": self.header_timeout_s, "lingering_time": LINGERING_TIME_S}}

    def as_kwargs(self) -> dict:
        """The four numbers by name, as `build_app` / `make_app` take them."""
        return asdict(self)


class InflightBudget:
    """The bytes of request bodies held now, all clients together, against `max_inflight_bytes`."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.held = 0

    @contextlib.contextmanager
    def reserve(self, request: web.Request) -> Iterator[int]:
        """Hold the bytes `request`'s body may take for the `with` block (yields that size).

        LimitExceeded 413 when the declared body is over `max_body_bytes`, 503 when it would take
        the held bytes past `max_inflight_bytes`. A body without a length (chunked) may grow to the
        per-body limit, so that much is reserved. Synchronous on purpose: on one event loop no other
        request runs between the check and the reservation.
        """
        size = request.content_length if request.content_length is not None else self.limits.max_body_bytes
        if size > self.limits.max_body_bytes:
            raise LimitExceeded(413, f"body exceeds max_body_bytes={self.limits.max_body_bytes}: "
                                     f"Content-Length is {size}")
        if self.held + size > self.limits.max_inflight_bytes:
            raise LimitExceeded(503, f"server busy: {self.held} bytes of request bodies in flight, "
                                     f"max_inflight_bytes={self.limits.max_inflight_bytes}; retry later")
        self.held += size
        try:
            yield size
        finally:
            self.held -= size


async def read_body(request: web.Request, limits: ServerLimits) -> bytes:
    """The whole body of `request`; LimitExceeded 408 if it has not arrived within `body_timeout_s`,
    413 if a body without a length grows past `max_body_bytes`."""
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise LimitExceeded(413, f"body exceeds max_body_bytes={limits.max_body_bytes}") from None
    except asyncio.TimeoutError:
        raise LimitExceeded(408, f"request body not received within body_timeout_s={limits.body_timeout_s:g} s"
                            ) from None


def add_limit_args(parser: argparse.ArgumentParser, defaults: ServerLimits) -> None:
    """The four limit flags, with this server's defaults; `from_args` reads them back."""
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="largest request body (413 above)")
    parser.add_argument("--max-inflight-bytes", type=int, default=defaults.max_inflight_bytes,
                        help="request bodies held at once, all clients together (503 above)")
    parser.add_argument("--header-timeout-s", type=float, default=defaults.header_timeout_s,
                        help="time a connection has to send its request headers (closed after)")
    parser.add_argument("--body-timeout-s", type=float, default=defaults.body_timeout_s,
                        help="time a request has to send its body (408 after)")


def from_args(args: argparse.Namespace) -> ServerLimits:
    """The limits given by `add_limit_args`' flags (checked: a bad value stops the server before it starts)."""
    return ServerLimits(args.max_body_bytes, args.max_inflight_bytes, args.header_timeout_s, args.body_timeout_s)


def warn_if_exposed(host: str | list[str] | None, token: str | None, what: str, how: str) -> bool:
    """Log a warning (and return True) when a server without a token binds an address other machines reach."""
    if token:
        return False
    hosts = [host] if host is None or isinstance(host, str) else list(host)
    exposed = [str(h) for h in hosts if not _is_loopback(h)]
    if exposed:
        logger.warning("%s binds %s without a token: anyone who can reach that address can use it; set %s",
                       what, ", ".join(exposed), how)
    return bool(exposed)


def _is_loopback(host: str | None) -> bool:
    """Whether `host` is this machine only. None and "" bind every interface; a name other than
    localhost may resolve anywhere."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
