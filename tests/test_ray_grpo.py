"""A GRPO run with rollout.backend=ray rollout.replicas=2 on toy-digits equals the local run step by step."""

import math

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'); the Ray pool tests need it")

from flywheel.runs.rundir import read_metrics  # noqa: E402
from recipe_kill import without_timings  # noqa: E402
from trainers.grpo import main  # noqa: E402
from launched import run_process_group

QUICK = ["tracker=none", "steps=3", "data.prompts_per_step=4", "data.group_size=8", "eval.seeds=1",
         "eval.every=1000", "save_every=1000", "sample_every=1000"]


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without timings, sync figures, versions and pool counts (what the two layouts must share)."""
    return [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()
             if not k.startswith(("sync/", "weight_version", "rollout/"))} for r in without_timings(rows)]


@pytest.mark.slow
def test_grpo_on_two_ray_replicas_equals_the_local_engine_step_by_step(tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        main([f"run_dir={tmp_path / 'local'}", *QUICK])
        main([f"run_dir={tmp_path / 'ray'}", *QUICK, "rollout.backend=ray", "rollout.replicas=2",
              "rollout.cpus_per_replica=0.5"])
    finally:
        ray.shutdown()
    local, pooled = read_metrics(tmp_path / "local" / "metrics.jsonl"), read_metrics(tmp_path / "ray" / "metrics.jsonl")
    assert len(local) == len(pooled) == 4  # the base evaluation row, then 3 steps
    assert comparable(pooled) == comparable(local)  # rewards, advantages, loss, KL, evaluation: bit for bit
    # The replicas start from the card's weights and take the trainer's in a first, verified sync (as the
    # engine process of rollout.asynchronous does), so their versions run one ahead of the colocated engine's.
    assert [r["weight_version"] for r in pooled] == [r["weight_version"] + 1 for r in local]
    steps = [r for r in pooled if "rollout/replica0/requests" in r]
    assert len(steps) == 3
    for before, after in zip(steps, steps[1:]):  # each step's 4 x 8 rows: 16 on each replica
        assert [after[f"rollout/replica{i}/requests"] - before[f"rollout/replica{i}/requests"] for i in (0, 1)] == \
            [16.0, 16.0]
    for row in steps:  # the row's metrics are read after its sync: every replica serves the synced version
        assert row["rollout/replica0/version"] == row["rollout/replica1/version"] == row["weight_version_after"]


@pytest.mark.slow
def test_under_accelerate_launch_each_rank_drives_its_replicas_and_the_run_equals_the_local_one(tmp_path):
    """Two trainer processes (DDP on the CPU) joined to a cluster started with `ray start --head`, one replica
    each: every metric of the run equals the same 2-process run without Ray."""
    import os
    import secrets
    import socket
    import subprocess
    import shutil
    import sys
    import tempfile
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Ray 2.60 clusters authenticate with a token: this cluster's own, given to the head and the drivers.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(root)}
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 characters
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                             "--disable-usage-stats", f"--temp-dir={temp}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    accelerate = root / "configs" / "accelerate" / "ddp.yaml"
    config = tmp_path / "ddp_cpu.yaml"
    config.write_text(accelerate.read_text().replace("use_cpu: false", "use_cpu: true"))
    args = [*QUICK, "steps=2", "data.prompts_per_step=4", "data.group_size=4"]

    fsdp_config = tmp_path / "fsdp_cpu.yaml"
    fsdp_config.write_text((root / "configs" / "accelerate" / "fsdp.yaml").read_text().replace("use_cpu: false",
                                                                                               "use_cpu: true"))

    def launch(name, *extra, fsdp=False):
        # fsdp: the FSDP config, made to shard on CPU processes by tests/cpu_fsdp.py (tests/test_fsdp_cpu.py)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(fsdp_config if fsdp else config),
               "--main_process_port", "0", *([str(root / "tests" / "cpu_fsdp.py")] if fsdp else []),
               str(root / "trainers" / "grpo.py"), f"run_dir={tmp_path / name}", *args, *extra]
        run_process_group(cmd, env=env, check=True, timeout=300, capture_output=True, cwd=root)
        return read_metrics(tmp_path / name / "metrics.jsonl")

    ray_keys = ["rollout.backend=ray", "rollout.replicas=2", "rollout.cpus_per_replica=0.5",
                f"rollout.address=127.0.0.1:{port}"]
    try:
        time.sleep(3)  # the head's GCS comes up
        pooled = launch("ray", *ray_keys)
        # Under FSDP the replicas get whole weights (a copy made inside the gather; the bare shards before,
        # and Ray's put of the gathered views left FSDP unable to free them).
        sharded = launch("ray_fsdp", *ray_keys, "model.finetune=full", fsdp=True)
    finally:
        head.terminate()
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
    local = launch("local")
    assert len(pooled) == len(local) == 3 and comparable(pooled) == comparable(local)
    local_full = launch("local_full", "model.finetune=full")
    assert [r.get("reward/mean") for r in sharded] == pytest.approx([r.get("reward/mean") for r in local_full],
                                                                    abs=1e-6, nan_ok=True)
