"""Command-line flags of the servers (`python -m engine.serve`, `python -m rewards.serve`): every flag checked
before anything loads, and a bad one answered as the trainers answer a bad config, with one line
`error: ...` naming the flag on stderr and exit status 2 (no usage block, no traceback)."""

from __future__ import annotations

import argparse
import math
import socket
import sys
from typing import NoReturn

USAGE_EXIT = 2  # as argparse and the trainers (flywheel/cli.py): the command line was wrong


def flag_error(message: str) -> NoReturn:
    """Print `error: message` to stderr and exit 2."""
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT)


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a value of the wrong type) are the one-line `error:` too."""

    def error(self, message: str) -> NoReturn:
        flag_error(f"{message} (see {self.prog} --help)")


def check_port(port: int, flag: str = "--port") -> None:
    if not 0 <= port <= 65535:
        flag_error(f"{flag} {port}: a TCP port is in 0..65535 (0 picks a free one)")


def check_positive(value, flag: str, integer: bool = True, allow_zero: bool = False) -> None:
    """A finite number > 0 (>= 0 with allow_zero)."""
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok):
        what = "an integer" if integer else "a finite number"
        flag_error(f"{flag} {value}: must be {what} {'>= 0' if allow_zero else '> 0'}")


def check_bind(host: str, port: int, flag: str = "--host/--port") -> None:
    """Bind (and close at once) the address the server will listen on: a host that does not resolve, or a port
    in use or not ours to take, is said now rather than after the model has loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        flag_error(f"--host {host}: not an address of this machine ({e})")
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as e:
            flag_error(f"{flag} {host}:{port}: cannot listen there ({e.strerror or e})")


def check_limits_and_address(args: argparse.Namespace):
    """The body/time limits of `engine.http_limits.add_limit_args` and the --host/--port a server binds, checked
    as every other flag (one `error:` line, exit 2); returns the limits."""
    from engine.http_limits import from_args

    try:
        limits = from_args(args)
    except ValueError as e:
        flag_error(f"--max-body-bytes/--max-inflight-bytes/--header-timeout-s/--body-timeout-s: {e}")
    check_port(args.port)
    check_bind(args.host, args.port)
    check_token(getattr(args, "token", None))
    return limits


def check_token(token: str | None) -> None:
    """An empty --token is refused: one server read it as "no token" (auth silently off) and the other as a
    token every client must send as a bare "Bearer "; an empty environment variable counts as unset."""
    if token is not None and not token.strip():
        flag_error("--token: the token is empty; give a non-empty token, or leave --token out to serve without one "
                   "(an empty environment variable counts as unset)")
