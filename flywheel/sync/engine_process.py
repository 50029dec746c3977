"""An Engine in its own process, driven over a local authenticated socket.

    handle = EngineProcess.start("toy-digits")       # spawns `python -m flywheel.sync.engine_process`
    traj = handle.generate([GenerationRequest(...)])  # a Trajectory of host tensors
    WeightSyncController(handle, transport=SharedMemoryTransport()).sync(tensors)

Messages are JSON (plus safetensors bytes for tensors), sent with
`multiprocessing.connection`'s `send_bytes`/`recv_bytes`: nothing is pickled.
Each client connection is served by its own thread, so a control connection
can pause, drain and load weights while a generation connection is busy.
Every call has a timeout that ends in an error naming the operation, and a
call to an engine process that has died ends in an error saying how it ended.

The engine process never outlives the process that started it, whatever ended
that one (SIGKILL included): a watchdog thread polls `os.getppid()` and the
parent's pid and, once the parent is gone, unlinks the engine's shared-memory
blocks and exits (status `EXIT_ORPHANED`). Why polling and not Linux's
`prctl(PR_SET_PDEATHSIG)`: that signal fires when the *thread* that spawned
the child ends, so an engine started from a worker thread would be killed
while its trainer lives on; it is also Linux-only, and as SIGKILL it leaves no
chance to unlink. The poll costs nothing measurable and notices within
`PARENT_POLL_S`. SIGTERM or SIGINT sent to the engine process itself, or a
`shutdown` call, unlinks its blocks and exits (status 128 + the signal's
number after a signal), a rollout in flight included.

It runs on the torch thread count of the process that starts it unless told
otherwise: CPU kernels round differently at another count, so its rollouts
equal a local Engine's bit for bit at equal thread counts on one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict
from multiprocessing.connection import Client, Listener

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from engine import Engine, GenerationRequest, Trajectory
from flywheel.guards import RunStoppedError
from flywheel.lora import add_lora
from flywheel.openmp_env import passive_wait_by_default
from flywheel.sync.transport import SharedWeights, receive_shared_memory_bucket, tensor_checksums

# Trajectory fields that travel as tensors (the optional ones only when present).
TRAJECTORY_TENSORS = ("latents", "log_probs", "timesteps", "noise_levels", "prompt_embeds", "pooled_prompt_embeds",
                      "prompt_mask", "negative_prompt_embeds", "negative_pooled_prompt_embeds",
                      "negative_prompt_mask", "images", "audio_noise_levels", "audio", "steps_computed")
EXTRA_PREFIX = "condition_extra."  # Trajectory.condition_extra's tensors travel under this prefix
MODALITY_PREFIX = "modality_log_probs."  # and Trajectory.modality_log_probs' under this one
PARENT_POLL_S = 0.2  # how often the engine process checks that its trainer is alive
EXIT_ORPHANED = 3  # exit status of an engine process whose trainer died
START_TIMEOUT_S = 1800.0  # spawn to serving: tens of GB of weights from a slow disk take minutes


def _request_from_json(d: dict) -> GenerationRequest:
    if d.get("sde_window") is not None:
        d = {**d, "sde_window": tuple(d["sde_window"])}
    return GenerationRequest(**d)


# ---- server (the engine process) --------------------------------------------------------------


class _Server:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.shared: dict[str, SharedWeights] = {}  # component -> its tensors mapped for a sender
        self.partial: str | None = None  # a component that buckets began to overwrite, not yet committed
        self.stop = threading.Event()
        self.shared_lock = threading.Lock()  # the parent-death watchdog must see every block map_shared made

    def unlink_shared(self) -> None:
        """Remove this engine's shared blocks from /dev/shm (the mappings stay valid until exit)."""
        # Bounded: a map_shared copying a huge model must not keep an orphan alive; a block it makes
        # after this is unlinked by the resource tracker when the process exits.
        locked = self.shared_lock.acquire(timeout=10)
        try:
            for block in self.shared.values():
                block.unlink()
        finally:
            if locked:
                self.shared_lock.release()

    def check_weights_complete(self) -> None:
        """Refuse to serve weights that a sync left half-written (its sender died or failed mid-transfer)."""
        broken = [c for c, block in self.shared.items() if block.incomplete] + [self.partial] * bool(self.partial)
        if broken:
            raise RuntimeError(f"the {', '.join(sorted(set(broken)))} weights were partly overwritten by a weight "
                               "sync that never committed; run the sync again before generating")

    def map_shared(self, names: list[str], component: str) -> dict:
        e = self.engine
        if e.device.type != "cpu":
            return {"mapped": False, "reason": f"the engine's weights are on {e.device}, not in host memory"}
        state = e.component(component).state_dict(keep_vars=True)
        unknown = [n for n in names if n not in state]
        if unknown:
            raise KeyError(f"{len(unknown)} tensor name(s) are not in {component}: {unknown[:5]}")
        with self.shared_lock:
            old = self.shared.get(component)
            wanted = list(dict.fromkeys([*(old.slots if old else []), *names]))
            block = SharedWeights({n: state[n] for n in wanted})
            self.shared[component] = block
            if old is not None:
                old.close()
        return {"mapped": True, "shm": block.name, "manifest": block.manifest()}

    def commit(self, version: int, component: str) -> dict:
        if component in self.shared:
            self.shared[component].commit()
        self.partial = None
        self.engine.set_weight_version(version, prompt_encoder_changed=self.engine.feeds_prompt_cache(component))
        return {"version": version, "component": component}

    def handle(self, op: str, msg: dict) -> tuple[dict, bytes | None]:
        e = self.engine
        if op == "generate":
            self.check_weights_complete()
            traj = e.generate([_request_from_json(r) for r in msg["requests"]])
            tensors = {k: getattr(traj, k).detach().cpu().contiguous() for k in TRAJECTORY_TENSORS
                       if getattr(traj, k) is not None}
            for prefix, named in ((EXTRA_PREFIX, traj.condition_extra), (MODALITY_PREFIX, traj.modality_log_probs)):
                for name, value in (named or {}).items():
                    tensors[prefix + name] = value.detach().cpu().contiguous()
            header = {"weight_version": traj.weight_version, "prompts": traj.prompts, "seeds": traj.seeds,
                      "card": traj.card, "guidance_scale": traj.guidance_scale, "metadata": traj.metadata,
                      "sampler": traj.sampler, "audio_elements": traj.audio_elements,
                      "audio_sample_rate": traj.audio_sample_rate}
            return header, save_safetensors(tensors)
        if op == "pause":
            e.pause(msg.get("mode", "drain"))
            return {}, None
        if op == "drain":
            return {"waited_s": e.drain(timeout_s=msg["wait_s"])}, None
        if op == "resume":
            e.resume()
            return {}, None
        if op == "version":
            return {"weight_version": e.weight_version}, None
        if op == "load_file":
            return e.load_weights(msg["path"], msg["version"], component=msg["component"]), None
        if op == "map_shared":
            return self.map_shared(msg["names"], msg["component"]), None
        if op == "receive_bucket":
            # Straight into the (drained) engine's tensors; `commit` marks the version.
            self.partial = msg["component"]
            views = receive_shared_memory_bucket(msg["shm"], msg["slots"], copy=False)
            return {"bytes": e.write_weights(views, msg["component"])}, None
        if op == "commit":
            return self.commit(msg["version"], msg["component"]), None
        if op == "checksums":
            state = e.component(msg["component"]).state_dict()
            return {"checksums": tensor_checksums({n: state[n] for n in msg["names"]})}, None
        if op == "shutdown":
            self.stop.set()
            return {}, None
        raise ValueError(f"unknown operation {op!r}")

    def serve_connection(self, conn) -> None:
        with conn:
            while not self.stop.is_set():
                try:
                    msg = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    return
                try:
                    reply, payload = self.handle(msg.get("op"), msg)
                    reply = {"ok": True, **reply, "has_payload": payload is not None}
                except Exception as exc:  # reported to the caller, the server keeps serving
                    reply, payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "has_payload": False}, None
                conn.send_bytes(json.dumps(reply).encode())
                if payload is not None:
                    conn.send_bytes(payload)


def exit_when_parent_dies(parent_pid: int, on_exit, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Start a daemon thread that calls `on_exit()` once the process `parent_pid` is gone.

    Gone means: this process was re-parented (an orphan goes to init or a
    subreaper, so its parent pid changes), or `parent_pid` no longer exists.
    The second test catches a parent that died before this thread started,
    and one that started this process through a launcher that forked.
    """
    first_parent = os.getppid()

    def parent_alive() -> bool:
        if os.getppid() != first_parent:
            return False
        try:
            os.kill(parent_pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return False
        except PermissionError:  # it exists, under another user
            pass
        return True

    def watch() -> None:
        while parent_alive():
            time.sleep(poll_s)
        on_exit()

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def serve(args: argparse.Namespace) -> None:
    server: _Server | None = None
    received: list[int] = []  # the signal that asked this process to stop, if one did

    def exit_orphaned() -> None:
        try:
            if server is not None:
                server.unlink_shared()
            print(f"flywheel engine process {os.getpid()}: the process that started it (pid {args.parent_pid}) "
                  "is gone; unlinked its shared memory, exiting", file=sys.stderr, flush=True)
        except OSError:  # stderr may have been a pipe the dead parent read; the exit must still happen
            pass
        finally:
            os._exit(EXIT_ORPHANED)  # at once: a rollout in flight has nobody to return to

    if args.parent_pid is not None:  # started before the engine loads: an orphan must not load a model first
        exit_when_parent_dies(args.parent_pid, exit_orphaned)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = Engine.from_card(args.card, path=args.path, device=args.device, weight_version=args.weight_version,
                              compile=args.compile)
    engine.model.transformer.eval()
    if args.lora_rank:
        # The same adapter layout as the trainer's, so LoRA-only syncs carry just the adapter.
        add_lora(engine.model.transformer, args.lora_rank, args.lora_alpha, args.lora_targets.split(","))
    server = _Server(engine)

    def stop_on_signal(signum, frame) -> None:
        received.append(signum)
        server.stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):  # a clean shutdown: the blocks are unlinked below
        signal.signal(signum, stop_on_signal)
    authkey = bytes.fromhex(os.environ["FLYWHEEL_ENGINE_AUTHKEY"])
    listener = Listener((args.host, args.port), authkey=authkey)
    print(json.dumps({"port": listener.address[1]}), flush=True)
    # Nobody reads the pipe after the port line; a later print (a library's warning, a progress bar)
    # filling it would block this process. Send stdout where stderr goes.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def accept_forever():
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError):  # a client that failed authentication, or the listener closed
                continue
            threading.Thread(target=server.serve_connection, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_forever, daemon=True).start()
    server.stop.wait()
    # Unlink the blocks but never unmap them: a connection thread may still be mid-rollout on these
    # weights. Nor let the interpreter tear down, which would unmap them under that thread (a crash).
    server.unlink_shared()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + received[0] if received else 0)  # 128 + N: the shell's "ended by signal N"


# ---- client (the trainer side) ----------------------------------------------------------------


class EngineProcessError(RunStoppedError):
    """The engine process died, did not start or stopped answering: the run stops at this step, its checkpoints
    the last good state, and the command line says so in one line with the resume command (flywheel/cli.py)
    rather than a traceback into the connection."""


class EngineProcessTimeout(EngineProcessError, TimeoutError):
    """The engine process did not answer (or start) within its time."""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal, or not a signal number at all
        return f"signal {signum}"


class EngineProcess:
    """A handle on an engine process: generation, and the engine side of weight sync."""

    def __init__(self, proc: subprocess.Popen, address: tuple[str, int], authkey: bytes, timeout_s: float,
                 card: str):
        self.proc, self.address, self.timeout_s, self.card = proc, address, timeout_s, card
        self._authkey = authkey
        self._connections = threading.local()
        # Set once a call went unanswered: the process may be stopped or stuck, and a new connection's handshake
        # (multiprocessing's Client) has no timeout, so close() must not try to talk to it again.
        self._unresponsive = False
        # Only this handle holds the key to the process: once it is dropped without close() (a main() that
        # raised, its locals collected) or the interpreter exits, nobody can use the process; stop it.
        self._stop_when_dropped = weakref.finalize(self, _stop_process, proc)

    @classmethod
    def start(cls, card: str, path: str | None = None, device: str = "cpu", threads: int | None = None,
              timeout_s: float = 120.0, lora: dict | None = None, weight_version: int = 0,
              compile: bool = False, start_timeout_s: float = START_TIMEOUT_S) -> "EngineProcess":
        """Spawn the engine process; `lora` = {"rank", "alpha", "targets"} injects the trainer's adapter layout,
        `compile` compiles its rollout forward (`Engine(compile=True)`). `timeout_s` bounds each call;
        `start_timeout_s` the start, model load included (TimeoutError, the process stopped).

        `threads`: its torch threads; by default this process's count, so that it rolls out bit for bit as an
        Engine here would (CPU kernels round differently at another thread count)."""
        authkey = secrets.token_bytes(32)
        threads = torch.get_num_threads() if threads is None else threads
        cmd = [sys.executable, "-m", "flywheel.sync.engine_process", "--card", card, "--device", device,
               "--threads", str(threads), "--weight-version", str(weight_version), "--parent-pid", str(os.getpid())] \
            + (["--path", path] if path else []) + (["--compile"] if compile else [])
        if lora:
            cmd += ["--lora-rank", str(lora["rank"]), "--lora-alpha", str(lora["alpha"]),
                    "--lora-targets", ",".join(lora["targets"])]
        env = {**os.environ, "FLYWHEEL_ENGINE_AUTHKEY": authkey.hex()}
        passive_wait_by_default(env)  # its OpenMP threads sleep when idle, unless the user chose (flywheel.openmp_env)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        port = _serving_port(proc, card, start_timeout_s)
        return cls(proc, ("127.0.0.1", port), authkey, timeout_s, card)

    def _conn(self):
        # One connection per calling thread: a control call never queues behind a generation.
        conn = getattr(self._connections, "conn", None)
        if conn is None:
            conn = self._connections.conn = Client(self.address, authkey=self._authkey)
        return conn

    def call(self, op: str, timeout_s: float | None = None, **msg) -> tuple[dict, bytes | None]:
        """Send one operation and wait for its answer."""
        conn = self._send(op, msg)
        return self._answer(conn, op, timeout_s)

    def _send(self, op: str, msg: dict):
        try:
            conn = self._conn()
            conn.send_bytes(json.dumps({"op": op, **msg}).encode())
        except (EOFError, ConnectionError) as exc:
            raise self._gone(op) from exc
        return conn

    def _answer(self, conn, op: str, timeout_s: float | None = None) -> tuple[dict, bytes | None]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            if not conn.poll(timeout):
                # The answer may still come, on this connection: a later call would read it as its own.
                self._connections.conn = None
                conn.close()
                self._unresponsive = True
                raise EngineProcessTimeout(f"engine process at {self.address[0]}:{self.address[1]} did not answer "
                                           f"{op!r} within {timeout:.3g}s (in a recipe: rollout.call_timeout_s); it may "
                                           "be stuck or stopped")
            reply = json.loads(conn.recv_bytes())
            payload = conn.recv_bytes() if reply.get("has_payload") else None
        except (EOFError, ConnectionError) as exc:
            raise self._gone(op) from exc
        if not reply["ok"]:
            raise RuntimeError(f"engine process {op!r} failed: {reply['error']}")
        return reply, payload

    def _gone(self, op: str) -> EngineProcessError:
        """The error for a call whose connection broke: the engine process died or was stopped."""
        self._connections.conn = None  # a later call from this thread reconnects (and fails the same way)
        try:
            code = self.proc.wait(timeout=5)  # the socket closes a moment before the exit is reported
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "closed its connection but is still running"
        elif code < 0:
            how = f"was killed by {_signal_name(-code)}"
        elif code > 128:
            how = f"exited with code {code} (stopped by {_signal_name(code - 128)})"
        else:
            how = f"exited with code {code}"
        return EngineProcessError(f"engine process (pid {self.proc.pid}, card {self.card!r}) {how} during {op!r}; "
                            "its weights and version are gone with it: start a new one (resume the run)")

    # -- generation
    @property
    def card_id(self) -> str:
        return self.card

    def generate(self, requests: list[GenerationRequest]) -> Trajectory:
        """Roll out in the engine process; the Trajectory comes back with host tensors."""
        reply, payload = self.call("generate", requests=[asdict(r) for r in requests])
        tensors = load_safetensors(payload)
        optional = {k: tensors.get(k) for k in TRAJECTORY_TENSORS}
        extra = {k[len(EXTRA_PREFIX):]: v for k, v in tensors.items() if k.startswith(EXTRA_PREFIX)}
        modality = {k[len(MODALITY_PREFIX):]: v for k, v in tensors.items() if k.startswith(MODALITY_PREFIX)}
        return Trajectory(**optional, prompts=reply["prompts"], seeds=reply["seeds"], card=reply["card"],
                          weight_version=reply["weight_version"], guidance_scale=reply["guidance_scale"],
                          metadata=reply["metadata"], sampler=reply["sampler"], condition_extra=extra or None,
                          audio_elements=reply["audio_elements"], audio_sample_rate=reply["audio_sample_rate"],
                          modality_log_probs=modality or None)

    # -- engine side of weight sync
    @property
    def weight_version(self) -> int:
        return self.call("version")[0]["weight_version"]

    def pause(self, mode: str = "drain") -> None:
        self.call("pause", mode=mode)

    def drain(self, timeout_s: float = 600.0) -> float:
        return self.call("drain", timeout_s=timeout_s + 5, wait_s=timeout_s)[0]["waited_s"]

    def resume(self) -> None:
        self.call("resume")

    def load_weights(self, path: str, version: int, component: str = "transformer") -> dict:
        return self.call("load_file", path=str(path), version=version, component=component)[0]

    def receive_bucket(self, shm_name: str, slots: list[dict], component: str = "transformer"):
        """Ask the engine process to copy a bucket into its (drained) weights; returns the wait for its
        answer, so the sender can pack the next bucket meanwhile (answers come back in order)."""
        conn = self._send("receive_bucket", {"shm": shm_name, "slots": slots, "component": component})
        return lambda: self._answer(conn, "receive_bucket")

    def map_shared(self, names: list[str], component: str = "transformer") -> dict:
        """Move the named tensors of `component` into a shared-memory block a sender can write into.

        Returns {"mapped": True, "shm": block name, "manifest": slots} or, for an
        engine whose weights are not in host memory, {"mapped": False, "reason": ...}.
        """
        return self.call("map_shared", names=list(names), component=component)[0]

    def commit_weights(self, version: int, component: str = "transformer") -> dict:
        """End a transfer: mark `version` (and drop the prompt cache on a prompt-encoder sync)."""
        return self.call("commit", version=version, component=component)[0]

    def checksums(self, names: list[str], component: str = "transformer") -> dict[str, str]:
        return self.call("checksums", names=names, component=component)[0]["checksums"]

    def close(self) -> None:
        if self.proc.poll() is None and not self._unresponsive:
            try:
                self.call("shutdown", timeout_s=10)
                self.proc.wait(timeout=10)
            except (OSError, EOFError, TimeoutError, RuntimeError, subprocess.TimeoutExpired):
                pass
        self._stop_when_dropped()  # if the shutdown got nowhere: SIGTERM, then SIGKILL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serving_port(proc: subprocess.Popen, card: str, timeout_s: float) -> int:
    """The port an engine process prints once it serves, read within `timeout_s` (the model loads first).

    Lines it prints before that (a library's warning on stdout) are passed on to stderr. An exit before
    serving is a RuntimeError; no port within the time a TimeoutError, after the process is stopped."""
    found: list[int] = []

    def read() -> None:
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if isinstance(message, dict) and isinstance(message.get("port"), int):
                found.append(message["port"])
                return
            sys.stderr.write(line)

    reader = threading.Thread(target=read, name="engine-process-start", daemon=True)
    reader.start()
    reader.join(timeout_s)
    if found:
        return found[0]
    if reader.is_alive():
        _stop_process(proc)
        raise EngineProcessTimeout(f"engine process (pid {proc.pid}) for card {card!r} did not start serving within "
                           f"{timeout_s:g}s (start_timeout_s; the model loads in that time); it was stopped")
    proc.wait(timeout=10)
    raise EngineProcessError(f"engine process for card {card!r} exited with code {proc.returncode} before serving "
                             "(its own error is printed above)")


def _stop_process(proc: subprocess.Popen, wait_s: float = 10.0) -> None:
    """Ask an engine process to stop (SIGTERM: it unlinks its shared memory), then make it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.send_signal(signal.SIGCONT)  # a stopped process (SIGSTOP, a debugger) handles its SIGTERM too
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve an engine to a trainer in another process (a recipe with "
                                                 "rollout.asynchronous=true starts it, with its key in "
                                                 "FLYWHEEL_ENGINE_AUTHKEY).")
    parser.add_argument("--card", default="toy-digits")
    parser.add_argument("--path", default=None, help="local weights folder of the card")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own count)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--weight-version", type=int, default=0, help="version of the weights it starts with")
    parser.add_argument("--compile", action="store_true", help="torch.compile the rollout forward")
    parser.add_argument("--lora-rank", type=int, default=0, help="inject a LoRA adapter of this rank (0: none)")
    parser.add_argument("--lora-alpha", type=float, default=8.0)
    parser.add_argument("--lora-targets", default="", help="comma-separated module names to adapt")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit (unlinking its shared memory) once this process is no longer the parent")
    args = parser.parse_args(argv)
    problems = _argument_problems(args)
    if problems:  # usage and one error line, exit 2, before the model loads
        parser.error("; ".join(problems))
    serve(args)


def _argument_problems(args) -> list[str]:
    from engine.cards import list_cards

    problems = []
    key = os.environ.get("FLYWHEEL_ENGINE_AUTHKEY", "")
    try:
        bytes.fromhex(key)
    except ValueError:
        key = ""
    if not key:
        problems.append("FLYWHEEL_ENGINE_AUTHKEY is not set to a hex key: the trainer that starts this process sets "
                        "it (rollout.asynchronous=true); run a recipe with that, or python -m engine.serve to serve "
                        "over HTTP")
    if args.card not in list_cards():
        problems.append(f"--card {args.card!r} is not a card; valid: {', '.join(list_cards())}")
    for flag, value, low in (("--threads", args.threads, 1), ("--weight-version", args.weight_version, 0),
                             ("--lora-rank", args.lora_rank, 0), ("--port", args.port, 0)):
        if value is not None and value < low:
            problems.append(f"{flag} {value}: must be >= {low}")
    if args.port > 65535:
        problems.append(f"--port {args.port}: must be <= 65535 (0 picks a free one)")
    return problems


if __name__ == "__main__":
    main()
