"""flywheel.runs.rundir: run dir layout, one run per directory, metrics.jsonl, image grids, atomic writes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from flywheel.runs.rundir import (
    MetricsLog,
    RunDir,
    RunDirInUseError,
    atomic_write_bytes,
    atomic_write_text,
    make_image_grid,
    read_metrics,
    save_image_grid,
)


def test_run_dir_layout(tmp_path):
    run = RunDir(tmp_path / "runs" / "exp")
    assert run.path.is_dir() and run.checkpoints_dir == run.path / "checkpoints"
    assert run.samples_dir == run.path / "samples" and run.samples_dir.is_dir()
    path = run.write_config({"seed": 1, "optim": {"lr": 0.001}, "size": [8, 8]})
    assert path == run.path / "config.yaml"
    assert yaml.safe_load(path.read_text()) == {"seed": 1, "optim": {"lr": 0.001}, "size": [8, 8]}
    assert run.sample_path(12).name == "samples_000012.png"


def used_run(path):
    """A directory a finished run left: config, metrics, a checkpoint, a sample, tracker logs, a LoRA export."""
    run = RunDir(path)
    run.write_config({"seed": 1})
    run.metrics.append({"step": 1, "loss": 0.5})
    (run.checkpoints_dir / "step_000001").mkdir()
    (run.checkpoints_dir / "step_000001" / "model.safetensors").write_bytes(b"x")
    (run.samples_dir / "samples_000001.png").write_bytes(b"png")
    for d in ("wandb/offline-run-1", "flywheel", "lora"):
        (run.path / d).mkdir(parents=True)
    (run.path / "flywheel" / "events.out.tfevents.1").write_bytes(b"tb")
    return run


def test_a_fresh_run_refuses_a_used_run_dir(tmp_path):
    used_run(tmp_path / "run")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(RunDirInUseError) as info:
        RunDir(tmp_path / "run")
    message = str(info.value)
    assert str(tmp_path / "run") in message and "config.yaml" in message and "metrics.jsonl" in message
    assert f"resume={tmp_path / 'run'}" in message and "overwrite=true" in message
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing touched
    # Each artifact alone makes a directory used.
    for name, make in [("config.yaml", lambda p: p.write_text("a: 1")), ("metrics.jsonl", lambda p: p.write_text("")),
                       ("checkpoints/step_000002", lambda p: p.mkdir(parents=True)),
                       ("samples/s.png", lambda p: (p.parent.mkdir(), p.write_bytes(b"")))]:
        d = tmp_path / name.replace("/", "_")
        d.mkdir()
        make(d / name)
        with pytest.raises(RunDirInUseError, match=name.split("/")[0]):
            RunDir(d)


def test_a_fresh_run_accepts_a_new_or_empty_dir(tmp_path):
    RunDir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    RunDir(tmp_path / "empty")
    RunDir(tmp_path / "new")  # only the empty dirs RunDir made: a run that stopped before writing anything


def test_overwrite_deletes_only_the_previous_runs_files(tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.bin").write_bytes(b"k")
    run = used_run(tmp_path / "run")
    (run.path / "notes.txt").write_text("mine")
    (run.path / "wandb" / "link").symlink_to(target)  # never followed
    (run.path / ".config.yaml.abc123.tmp").write_text("torn")  # an atomic write that was killed
    for written in ("best", ".best.old", "abandoned/after_step_1_x/step_000002"):  # best/ used to be kept
        (run.path / written).mkdir(parents=True)
        (run.path / written / "weights.safetensors").write_bytes(b"w")
    fresh = RunDir(run.path, mode="overwrite", tracker_dirs=("flywheel",))
    # One plain line (a warnings.warn printed its source line under it).
    assert capsys.readouterr().err == f"warning: overwrite=true: kept notes.txt in {run.path} (not files a run writes)\n"
    assert sorted(p.name for p in fresh.path.iterdir()) == ["checkpoints", "notes.txt", "samples"]
    assert not any(fresh.checkpoints_dir.iterdir()) and not any(fresh.samples_dir.iterdir())
    assert fresh.metrics.read() == [] and (target / "keep.bin").read_bytes() == b"k"
    RunDir(tmp_path / "never-used", mode="overwrite")  # nothing to delete is fine


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "home" / "checkpoints").mkdir(parents=True)
    (tmp_path / "home" / "checkpoints" / "precious.bin").write_bytes(b"p")
    with pytest.raises(RunDirInUseError, match=r"no config\.yaml.*nothing was deleted"):
        RunDir(tmp_path / "home", mode="overwrite")
    assert (tmp_path / "home" / "checkpoints" / "precious.bin").read_bytes() == b"p"


def test_resume_mode_keeps_the_run_and_needs_its_config(tmp_path):
    run = used_run(tmp_path / "run")
    resumed = RunDir(run.path, mode="resume")
    assert resumed.metrics.read() == [{"step": 1, "loss": 0.5}]
    assert (run.checkpoints_dir / "step_000001" / "model.safetensors").exists()
    run.config_path.unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.yaml is missing"):
        RunDir(run.path, mode="resume")


def test_run_dir_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="new, resume, overwrite"):
        RunDir(tmp_path, mode="append")
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError, match="tracker_dirs"):
            RunDir(tmp_path, tracker_dirs=(bad,))


def test_only_the_main_process_checks_and_clears(tmp_path):
    run = used_run(tmp_path / "run")
    (run.metrics_path).write_text('{"step": 1}\n{"step": 2, "lo')  # torn by a killed writer
    other = RunDir(run.path, mode="overwrite", is_main_process=False)
    assert other.checkpoints_dir == run.checkpoints_dir and run.config_path.exists()
    assert run.metrics_path.read_text().endswith('"lo')  # only the writer repairs metrics.jsonl
    RunDir(tmp_path / "run", is_main_process=False)  # the main process is the one that refuses


def test_atomic_write_leaves_no_temp_files(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "one")
    atomic_write_text(tmp_path / "a.txt", "two")
    atomic_write_bytes(tmp_path / "sub" / "b.bin", b"\x00\x01")
    assert (tmp_path / "a.txt").read_text() == "two"
    assert (tmp_path / "sub" / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "sub"]


def test_metrics_append_and_read(tmp_path):
    log = MetricsLog(tmp_path)  # a directory means its metrics.jsonl
    assert log.path == tmp_path / "metrics.jsonl"
    log.append({"step": 1, "loss": 0.5, "name": "a", "ok": True})
    log.append({"step": 2, "loss": torch.tensor(0.25), "kl": np.float32(0.125), "n": np.int64(3)})
    rows = read_metrics(log.path)
    assert rows == [
        {"step": 1, "loss": 0.5, "name": "a", "ok": True},
        {"step": 2, "loss": 0.25, "kl": 0.125, "n": 3},
    ]
    assert read_metrics(tmp_path) == rows
    # one JSON object per line
    lines = log.path.read_text().splitlines()
    assert len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines)


def test_metrics_nan_and_inf_written_as_null(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"step": 0, "a": math.nan, "b": float("inf"), "c": torch.tensor(float("nan"))})
    assert "NaN" not in log.path.read_text() and "Infinity" not in log.path.read_text()
    assert read_metrics(log.path) == [{"step": 0, "a": None, "b": None, "c": None}]


def test_metrics_rejects_non_scalars(tmp_path):
    log = MetricsLog(tmp_path)
    with pytest.raises(TypeError, match="'x'"):
        log.append({"x": torch.zeros(3)})
    with pytest.raises(TypeError, match="'y'"):
        log.append({"y": object()})


def test_metrics_truncate_after(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(6):
        log.append({"step": step, "loss": float(step)})
    log.append({"note": "no step"})
    assert log.truncate_after(3) == 2
    assert [r.get("step") for r in read_metrics(log.path)] == [0, 1, 2, 3, None]
    log.append({"step": 4, "loss": 40.0})
    assert [r.get("step") for r in log.read()] == [0, 1, 2, 3, None, 4]
    assert MetricsLog(tmp_path / "other.jsonl").truncate_after(0) == 0  # no file yet


def test_metrics_partial_trailing_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}]
    # a resumed writer drops the torn line instead of gluing its row onto it
    log = MetricsLog(path)
    log.append({"step": 2, "loss": 0.25})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


def test_metrics_complete_last_row_without_newline_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    MetricsLog(path).append({"step": 2})
    assert read_metrics(path) == [{"step": 0}, {"step": 1}, {"step": 2}]


def test_metrics_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{broken\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_read_metrics_missing_file(tmp_path):
    assert read_metrics(tmp_path / "nope.jsonl") == []


def test_image_grid_size_and_pixels(tmp_path):
    images = torch.zeros(5, 1, 8, 8)
    images[0] = 1.0  # white
    images[1] = 0.5
    img = save_image_grid(images, tmp_path / "grid.png", upscale=4, padding=1)
    # 5 images -> ceil(sqrt(5)) = 3 columns, 2 rows; 1 px padding around and between; x4
    assert img.size == ((3 * (8 + 1) + 1) * 4, (2 * (8 + 1) + 1) * 4)
    assert img.mode == "L"
    on_disk = Image.open(tmp_path / "grid.png")
    assert on_disk.size == img.size
    a = np.asarray(on_disk)
    assert a[4:36, 4:36].min() == 255  # the white image, upscaled 8 -> 32 px
    assert (a[4:36, 40:72] == 128).all()  # 0.5 -> round(127.5) = 128
    assert (a[4:36, 76:108] == 0).all()
    assert (a[0:4, :] == 128).all()  # padding (grey), also upscaled
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]


def test_image_grid_rgb_nrow_clamp():
    images = torch.zeros(4, 3, 2, 2)
    images[:, 0] = 1.0  # red
    images[3] = 7.0  # clamped to white
    img = make_image_grid(images, nrow=4, upscale=1, padding=0)
    assert img.mode == "RGB" and img.size == (8, 2)
    a = np.asarray(img)
    assert tuple(a[0, 0]) == (255, 0, 0) and tuple(a[0, 7]) == (255, 255, 255)


def test_image_grid_bad_shape():
    with pytest.raises(ValueError, match="C = 1 or 3"):
        make_image_grid(torch.zeros(2, 2, 8, 8))


@pytest.mark.parametrize("text, message", [
    ("garbage", "line 1 is not valid JSON"),  # no row at all: not a killed writer's partial line
    ('{"step": 0}\nnot a row', "line 2 is not valid JSON"),
    ('{"step": 0}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
    ('7\n', "line 1 is a JSON int, not an object"),
])
def test_metrics_that_are_not_rows_are_an_error_not_an_empty_run(tmp_path, text, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_metrics(path)


def test_metrics_log_does_not_cut_a_last_line_it_did_not_begin(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\ngarbage')
    with pytest.raises(ValueError, match="the last line is not a metrics row"):
        MetricsLog(path)
    assert path.read_text() == '{"step": 0}\ngarbage'  # nothing lost


def test_metrics_partial_row_of_a_killed_writer_is_still_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "rew')
    assert read_metrics(path) == [{"step": 0}]
