"""tracker=trackio: a short run logs metrics, config and the sample grid; its local dashboard, loaded in headless
Chromium, shows the run and its reward metric."""

import importlib.util
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flywheel.runs.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RUN_NAME = "dash-run-7"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("trackio") is None,
                                reason="tracker=trackio needs trackio: pip install -e .[dashboards]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def trackio_run(tmp_path_factory):
    """A two-step GRPO run logged to trackio in its own TRACKIO_DIR (trackio reads it when imported)."""
    base = tmp_path_factory.mktemp("trackio")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACKIO_DIR": str(base / "store"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "trainers" / "grpo.py"), f"run_dir={base / RUN_NAME}",
                           "tracker=trackio", "project=flytest", "steps=2", "eval.every=2", "sample_every=2",
                           "eval.seeds=1", "data.prompts_per_step=2", "data.group_size=4", "save_every=1000"],
                          cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
    return base, env, done.stdout + done.stderr


def test_trackio_logs_the_runs_metrics_config_and_sample_grids(trackio_run):
    base, _, output = trackio_run
    # The run is finished once (accelerate's tracker left it as trackio's current run, finished again at exit).
    assert output.count("Run finished") == 1, output[-2000:]
    db = sqlite3.connect(base / "store" / "flytest.db")
    logged = {}
    for run_name, step, blob in db.execute("select run_name, step, metrics from metrics"):
        assert run_name == RUN_NAME
        logged.setdefault(step, {}).update(json.loads(blob))
    rows = read_metrics(base / RUN_NAME / "metrics.jsonl")
    for row in rows:  # every metric of metrics.jsonl, at its step
        for key in ("reward/mean", "eval/reward/mean", "eval/judge/digit_svc/mean"):
            if key in row:
                assert logged[row["step"]][key] == pytest.approx(row[key]), (row["step"], key)
    assert {s for s, m in logged.items() if m.get("eval/samples", {}).get("_type") == "trackio.image"} == {0, 2}
    (config,) = [json.loads(c) for (c,) in db.execute("select config from configs")]
    assert config["reward.scorers"] == "digit_alignment:1.0" and config["steps"] == 2


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_trackio_dashboard_in_headless_chromium_shows_the_run_and_its_reward(trackio_run, tmp_path):
    base, env, _ = trackio_run
    port = free_port()
    show = subprocess.Popen([sys.executable, "-c", "import sys, trackio; trackio.show(project='flytest', "
                             f"open_browser=False, block_thread=True, host='127.0.0.1', server_port={port})"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/?project=flytest"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    assert reply.status == 200
                break
            except OSError:
                assert show.poll() is None, "the trackio dashboard exited"
                assert time.monotonic() < deadline, "the trackio dashboard did not answer within 60 s"
                time.sleep(0.5)
        chrome = ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--window-size=1280,900", "--virtual-time-budget=15000"]
        dom = subprocess.run([*chrome, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        assert RUN_NAME in dom and "reward/mean" in dom
        shot = tmp_path / "dashboard.png"
        subprocess.run([*chrome, f"--screenshot={shot}", url], capture_output=True, timeout=120)
        from PIL import Image, ImageStat

        image = Image.open(shot).convert("RGB")
        assert image.size == (1280, 900)
        # Not blank: a page of one colour has no spread and a handful of colours; the charts give many.
        assert max(ImageStat.Stat(image).stddev) > 10 and len(image.getcolors(1 << 20) or []) > 100
    finally:
        show.terminate()
        show.wait(timeout=30)
