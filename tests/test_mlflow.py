"""tracker=mlflow (and several trackers at once): metrics, config and the judge-framed sample grid reach MLflow."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.runs.rundir import read_metrics
from flywheel.runs.tracking import tracker_names

ROOT = Path(__file__).resolve().parents[1]
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="tracker=mlflow needs mlflow: pip install -e .[dashboards]")
RUN = ["steps=2", "eval.every=2", "sample_every=2", "eval.seeds=1", "data.prompts_per_step=2",
       "data.group_size=4", "save_every=1000", "project=flytest"]


def test_mlflow_tracker_names_take_several_and_refuse_bad_ones():
    assert tracker_names("wandb,trackio") == ["wandb", "trackio"]
    assert tracker_names(" mlflow ") == ["mlflow"] and tracker_names("none") == []
    for bad in ("wandbx", "wandb,none", "wandb,wandb", ""):
        with pytest.raises(ValueError, match="tracker="):
            tracker_names(bad)
    from flywheel.runs.config import ConfigError, parse_config
    from trainers.grpo import Config, validate_config

    with pytest.raises(ConfigError, match="tracker='mlflow,tensorbored'"):
        validate_config(parse_config(Config, ["tracker=mlflow,tensorbored"]))


@needs_mlflow
def test_mlflow_and_wandb_together_log_the_runs_metrics_config_and_grids(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    subprocess.run([sys.executable, str(ROOT / "trainers" / "grpo.py"), f"run_dir={run_dir}", "tracker=mlflow,wandb",
                    *RUN], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the run's file store, as the tracker opened it
    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("flytest")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run"
    rows = read_metrics(run_dir / "metrics.jsonl")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward/mean")}
    assert history == pytest.approx({r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r})
    evals = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/judge/digit_svc/mean")}
    assert sorted(evals) == [0, 2]
    assert run.data.params["reward.scorers"] == "digit_alignment:1.0" and run.data.params["steps"] == "2"
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    assert sum(p.endswith(".png") and "eval_samples" in p for p in images) == 2  # the grid at steps 0 and 2
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb, the other tracker, wrote no run"
