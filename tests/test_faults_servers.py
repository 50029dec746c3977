"""Fault injection against the servers: a reward server killed or hung, a server trickling its reply,
and slow HTTP clients against both servers. Each must end in a clear error, or a correct continuation,
within a wall-clock bound (never retries x timeout, never a hang).

The misbehaving servers and clients are tiny in-test ones on 127.0.0.1, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import rewards
from rewards import RewardSet
from rewards.remote import RemoteRewardError, RemoteScorer
from rewards.serve import ServerThread
from rewards.wire import encode_request

PROMPTS = ["three", "seven", "a 0", "digit 5"]


def _images() -> torch.Tensor:
    return torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(5))


class ScriptedServer:
    """A loopback HTTP server that answers /health like a reward server and handles POST /score with
    `on_score(handler, stop)`: hang, trickle, or anything else a broken server does. `close()` ends it
    and releases every handler still waiting."""

    def __init__(self, on_score):
        stop = self.stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                body = json.dumps({"status": "ok", "reward": "scripted"}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    on_score(self, stop)
                except OSError:  # the client hung up: what a cut-off client does
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "ScriptedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _hang(handler, stop) -> None:
    stop.wait(30)  # accepts the request, never answers


def _trickle_body(handler, stop) -> None:
    """Valid headers, then a 300-byte body at one byte per 0.1 s: every single read is quick."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", "300")
    handler.end_headers()
    for _ in range(300):
        handler.wfile.write(b" ")
        handler.wfile.flush()
        if stop.wait(0.1):
            return


def _trickle_headers(handler, stop) -> None:
    """The status line and headers themselves a byte per 0.1 s (http.client reads them in one call)."""
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Pad: " + b"a" * 300:
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        if stop.wait(0.1):
            return


# ---- the client against broken servers ----

def test_hung_server_is_bounded_by_the_budget_not_retries_times_timeout():
    with ScriptedServer(_hang) as server:
        # Old behaviour: 6 attempts x 1 s + 3.1 s of backoff = 9 s; the budget makes it 2.5 s.
        scorer = RemoteScorer(server.url, timeout_s=1.0, budget_s=2.5, retries=5, backoff_s=0.1)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError) as err:
            scorer(_images(), PROMPTS, [{}] * 4)
        elapsed = time.monotonic() - start
        message = str(err.value)
        assert server.url in message and "budget_s=2.5" in message and "timeout_s=1" in message
        assert "no complete reply within" in message
        assert 2.0 <= elapsed < 4.5, elapsed  # used its budget, and no more
        # Through a RewardSet the batch is masked and counted, the step goes on.
        reward_set = RewardSet(f"remote:{server.url}", remote_timeout_s=0.5, remote_budget_s=1.0)
        start = time.monotonic()
        batch = reward_set.score(_images(), PROMPTS, None, weight_version=3)
        assert time.monotonic() - start < 3.0
        name = f"remote:{server.url}"
        assert not batch.valid.any() and batch.total.isnan().all()
        assert server.url in batch.errors[name] and "budget_s=1" in batch.errors[name]
        assert batch.metrics()[f"reward/{name}/invalid"] == 4


@pytest.mark.parametrize("behaviour", [_trickle_body, _trickle_headers], ids=["body", "headers"])
def test_trickling_server_is_cut_at_the_wall_clock_deadline(behaviour):
    with ScriptedServer(behaviour) as server:
        scorer = RemoteScorer(server.url, timeout_s=1.0, budget_s=1.0, retries=0)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match="no complete reply within timeout_s=1") as err:
            scorer(_images(), PROMPTS, [{}] * 4)
        # A per-read socket timeout never fires here: the old client waited the full 30 s of trickle.
        assert time.monotonic() - start < 3.0
        assert server.url in str(err.value)


_SERVE_SLOW_REWARD = """
import time, torch
from rewards.registry import register
from rewards.serve import main

def score(images, prompts, metadata):
    if prompts[0] == "hang":
        time.sleep(60)  # a batch still being scored when the process is killed
    return torch.arange(len(prompts), dtype=torch.float32)

register("arange", lambda: score)
main(["--reward", "arange", "--port", "0"])
"""


def test_reward_server_killed_mid_batch_ends_in_a_clear_error_then_masked_batches():
    env = {k: v for k, v in os.environ.items() if k != "FLYWHEEL_REWARD_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_SLOW_REWARD], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        while "serving reward" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "server exited before printing its address"
        url = line.strip().rsplit(" ", 1)[-1]
        scorer = RemoteScorer(url, timeout_s=30.0, budget_s=60.0, retries=2, backoff_s=0.05)
        assert scorer(_images(), PROMPTS, [{}] * 4).tolist() == [0.0, 1.0, 2.0, 3.0]
        reward_set = RewardSet(f"digit_alignment,remote:{url}", remote_timeout_s=30.0, remote_budget_s=60.0)
        killer = threading.Timer(0.5, proc.kill)  # SIGKILL while the server holds the batch
        killer.start()
        start = time.monotonic()
        with pytest.raises(RemoteRewardError) as err:
            scorer(_images(), ["hang"] * 4, [{}] * 4)
        # The dead peer is seen at once (reset, then refused), not after the 30 s timeout.
        assert time.monotonic() - start < 5.0
        assert url in str(err.value) and "3 attempts" in str(err.value)
        start = time.monotonic()
        batch = reward_set.score(_images(), PROMPTS, None, weight_version=0)
        assert batch.valid_per_scorer["digit_alignment"].all() and not batch.valid.any()
        assert time.monotonic() - start < 5.0
        assert url in batch.errors[f"remote:{url}"] and "ConnectionRefusedError" in batch.errors[f"remote:{url}"]
    finally:
        proc.kill()
        proc.wait(timeout=10)


# ---- slow HTTP clients against the servers ----

def _slow_client(port: int, prefix: bytes, trickle: bytes, delay_s: float = 0.1, give_up_s: float = 8.0):
    """A thread that connects, sends `prefix` at once, then `trickle` one byte per `delay_s`, reading what
    the server says. `result` is set to (seconds until the server closed the connection, what it answered),
    or stays None if the server was still holding the connection after `give_up_s`."""
    box: dict = {"result": None}

    def run() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            opened, answer = time.monotonic(), b""
            sock.sendall(prefix)
            sock.settimeout(delay_s)
            pending = list(trickle)
            while time.monotonic() - opened < give_up_s:
                try:
                    if pending:
                        sock.sendall(bytes([pending.pop(0)]))
                    chunk = sock.recv(4096)
                except socket.timeout:
                    continue
                except OSError:  # reset: closed too
                    chunk = b""
                if not chunk:
                    box["result"] = (time.monotonic() - opened, answer)
                    return
                answer += chunk

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _wait(clients) -> list:
    for thread, _ in clients:
        thread.join(timeout=12)
    return [box["result"] for _, box in clients]


def _check_slow_clients(heads: list, bodies: list, header_s: float, body_s: float) -> None:
    # Header trickle: closed without an answer about `header_s` in (the whole request would take over a minute).
    for r in heads:
        assert r is not None and header_s * 0.8 <= r[0] < header_s + 2.5 and r[1] == b"", heads
    # Body trickle: a 408 naming the limit about `body_s` in, then closed (after at most 2 s of draining).
    for r in bodies:
        assert r is not None and body_s * 0.8 <= r[0] < body_s + 4.5, bodies
        assert r[1].startswith(b"HTTP/1.1 408") and f"body_timeout_s={body_s:g}".encode() in r[1], r[1][:300]


def test_slow_clients_are_cut_off_and_do_not_block_the_reward_server():
    scorer = rewards.get("jpeg_compressibility")
    body, content_type = encode_request(_images(), PROMPTS, [{}] * 4)
    head = (f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with ServerThread(scorer, "jpeg_compressibility", header_timeout_s=1.0, body_timeout_s=1.0) as server:
        heads = [_slow_client(server.port, b"", head + body) for _ in range(3)]
        bodies = [_slow_client(server.port, head, body) for _ in range(2)]
        time.sleep(0.3)  # all five connections are open and trickling
        start = time.monotonic()  # meanwhile a well-behaved client is served at once
        scores = RemoteScorer(server.url, timeout_s=5.0, budget_s=5.0)(_images(), PROMPTS, [{}] * 4)
        assert time.monotonic() - start < 5.0  # the slow clients hold their connections ~1-3 s each, never the server
        assert torch.equal(scores, scorer(_images(), PROMPTS, [{}] * 4))
        head_results, body_results = _wait(heads), _wait(bodies)
    _check_slow_clients(head_results, body_results, 1.0, 1.0)


def test_slow_clients_are_cut_off_and_do_not_block_the_engine_server(toy_model):
    from aiohttp.test_utils import TestClient, TestServer

    from engine import AsyncEngine, Engine
    from engine.serve import build_app

    body = json.dumps({"prompt": "a handwritten two", "steps": 2}).encode()
    head = (f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()

    async def main():
        app = build_app(AsyncEngine(Engine(toy_model)), header_timeout_s=1.0, body_timeout_s=1.5)
        async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
            port = client.server.port
            heads = [_slow_client(port, b"", head + body) for _ in range(4)]
            bodies = [_slow_client(port, head, body) for _ in range(2)]
            await asyncio.sleep(0.3)
            start = time.monotonic()
            good = await client.post("/v1/generate", data=body, headers={"Content-Type": "application/json"})
            served = (good.status, time.monotonic() - start)
            results = await asyncio.to_thread(lambda: (_wait(heads), _wait(bodies)))
            return served, results

    (status, seconds), (head_results, body_results) = asyncio.run(main())
    assert status == 200 and seconds < 5.0
    _check_slow_clients(head_results, body_results, 1.0, 1.5)


# ---- a server that answers nonsense ----

def _answer(body: bytes, length: bool = True):
    def on_score(handler, stop) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if length:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return on_score


@pytest.mark.parametrize("reply, fragment", [
    (b'{"scores": ["1", "2", "3", "4"]}', 'score 0 is "1", not a number or null'),
    (b'{"scores": [1, true, 3, 4]}', "score 1 is true, not a number or null"),
    (b'{"scores": [1, 2, [3], 4]}', "score 2 is [3], not a number or null"),
    (b'{"scores": [1, 2, 3, {"a": 4}]}', 'score 3 is {"a": 4}, not a number or null'),
    (b'{"scores": [1, 2, 3, 1' + b"0" * 400 + b"]}", "is too large for a float"),
    # A double that float32 cannot hold: it was stored as inf and masked like a null.
    (b'{"scores": [1, 2, 3, 1e300]}', "score 3 (1e+300) is beyond float32's range"),
    (b'{"scores": [1, 2]}', "returned 2 scores for a batch of 4"),
    (b'{"score": [1, 2, 3, 4]}', 'reply has no "scores" list'),
    (b"<html>gateway error</html>", "reply is not JSON"),
], ids=["string", "bool", "list", "object", "huge-int", "beyond-float32", "short", "no-scores", "html"])
def test_replies_that_are_not_scores_are_refused_naming_what_came_back(reply, fragment):
    with ScriptedServer(_answer(reply)) as server:
        scorer = RemoteScorer(server.url, timeout_s=5.0, budget_s=5.0, retries=2)
        with pytest.raises(RemoteRewardError) as err:
            scorer(_images(), PROMPTS, [{}] * 4)
    assert fragment in str(err.value) and server.url in str(err.value)


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "read-until-close"])
def test_replies_over_the_size_limit_are_refused(length):
    with ScriptedServer(_answer(b'{"scores": [1, 2, 3, 4]}' + b" " * 5000, length)) as server:
        scorer = RemoteScorer(server.url, max_reply_bytes=1000)
        with pytest.raises(RemoteRewardError, match="max_reply_bytes=1000") as err:
            scorer(_images(), PROMPTS, [{}] * 4)
    assert server.url in str(err.value)
    # Infinity and null are numbers a server may send: masked rows, not errors.
    with ScriptedServer(_answer(b'{"scores": [1, null, Infinity, -1e999]}')) as server:
        scores = RemoteScorer(server.url)(_images(), PROMPTS, [{}] * 4)
    assert scores[0] == 1 and scores[1:].isnan().all()
