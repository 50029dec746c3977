"""What a run leaves for its user to find: video samples named by their prompt, and the wandb-offline line.

The video run is a one-step GRPO run on a tiny Wan2.1 folder written by
`tests/tiny_models`; the wandb check makes a real offline wandb run in the
run directory and syncs nothing (no network), only checks that the printed
`wandb sync` path names the folder wandb wrote.
"""

import glob
import shlex

import pytest

from flywheel.runs.tracking import prepare_tracker, wandb_offline_line
from flywheel.video import SLUG_MAX_CHARS, prompt_slug, sample_file_name


@pytest.mark.parametrize("prompt, slug", [
    ("A red cat", "a-red-cat"),
    ('a sign that says "OPEN/../etc" on it.', "a-sign-that-says-open-etc-on-it"),  # no path characters survive
    ("  Crème brûlée, au café  ", "creme-brulee-au-cafe"),  # accents to their letters, spaces trimmed
    ("tab\tand\nnewline", "tab-and-newline"),
    ("猫", "prompt"), ("", "prompt"), ("?!*", "prompt"),  # nothing left: a placeholder, never an empty name
    ("number 7, written neatly", "number-7-written-neatly"),
])
def test_prompt_slugs_are_safe_file_names(prompt, slug):
    assert prompt_slug(prompt) == slug


def test_a_long_prompt_is_cut_on_a_word_boundary_within_the_bound():
    prompt = "a watercolor painting of a lighthouse on a rocky coast at sunset with seagulls"
    slug = prompt_slug(prompt)
    assert slug == "a-watercolor-painting-of-a-lighthouse-on-a-rocky"
    assert len(slug) <= SLUG_MAX_CHARS and prompt_slug(prompt, max_chars=12) == "a-watercolor"
    assert prompt_slug("x" * 100) == "x" * SLUG_MAX_CHARS  # one long word: cut inside it
    assert sample_file_name(20, 3, "A red cat", ".mp4") == "step-000020-03-a-red-cat.mp4"


@pytest.mark.slow  # a tiny Wan folder and a one-step run with two evaluations: ~10 s of CPU, more on a busy machine
def test_video_samples_are_named_by_their_prompt(tmp_path):
    from tiny_models.folders import smoke_command, write_tiny_folder
    from trainers.grpo import main as grpo_main

    folder = write_tiny_folder("wan2.1-t2v", tmp_path / "wan")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\nA blue dog, on a mat\n")
    argv = shlex.split(smoke_command("wan2.1-t2v", folder))[2:]
    grpo_main([*(a.replace("PROMPTS.txt", str(prompts)) for a in argv if not a.startswith("run_dir=")),
               f"run_dir={tmp_path / 'run'}"])
    names = sorted(p.name for p in (tmp_path / "run" / "samples").glob("*.mp4"))
    # The base evaluation (step 0) and the final one (step 1), one clip per eval prompt, in prompt order.
    assert names == ["step-000000-00-a-red-cat.mp4", "step-000000-01-a-blue-dog-on-a-mat.mp4",
                     "step-000001-00-a-red-cat.mp4", "step-000001-01-a-blue-dog-on-a-mat.mp4"]


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """No WANDB_MODE, no API key, a HOME without ~/.netrc; the variables prepare_tracker sets are restored."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SILENT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.mark.slow  # a real offline wandb run (its service process starts): ~5 s, up to 20 s on a busy machine
def test_wandb_offline_says_so_once_with_the_sync_command(no_wandb_account, tmp_path, capsys, monkeypatch):
    import os

    run_dir = tmp_path / "run"
    kwargs = prepare_tracker("wandb", run_dir)
    assert os.environ["WANDB_MODE"] == "offline"
    line = f"wandb is offline (no wandb account configured): sync with `wandb sync {run_dir}/wandb/offline-run-*`"
    assert capsys.readouterr().out == line + "\n"
    assert wandb_offline_line(run_dir, "no wandb account configured") == line

    # The path in the line is where wandb writes an offline run with these init kwargs.
    import wandb

    run = wandb.init(project="flywheel", **kwargs["wandb"])
    run.log({"a": 1.0})
    run.finish()
    pattern = line.split("wandb sync ")[1].rstrip("`")
    assert len(glob.glob(pattern)) == 1

    # WANDB_MODE=offline set by the user: said too, with that reason; other ranks, online and tensorboard: silent.
    prepare_tracker("wandb", run_dir)
    assert capsys.readouterr().out.startswith("wandb is offline (WANDB_MODE=offline): sync with `wandb sync ")
    monkeypatch.setenv("RANK", "1")
    prepare_tracker("wandb", run_dir)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WANDB_MODE", "online")
    prepare_tracker("wandb", run_dir)
    prepare_tracker("none", run_dir)
    assert capsys.readouterr().out == ""


@pytest.mark.slow  # a one-step toy run with two evaluations: ~5 s of CPU, longer on a busy machine
def test_tensorboard_writes_into_the_project_folder_of_the_run_dir(tmp_path, monkeypatch):
    """docs/getting-started.md: tracker=tensorboard writes into <run_dir>/<project>/ (accelerate's tracker,
    named by `project`).

    Without the tensorboard package a stand-in tensorboardX SummaryWriter records where it was opened and
    what was logged; with it, the real event files are looked for.
    """
    import importlib.machinery
    import importlib.util
    import sys
    import types

    from trainers.grpo import main as grpo_main

    writers = []

    class RecordingWriter:
        def __init__(self, logdir, **kwargs):
            self.logdir, self.scalars = logdir, {}
            writers.append(self)

        def add_scalar(self, key, value, global_step=None, **kwargs):
            self.scalars.setdefault(key, []).append((global_step, value))

        def __getattr__(self, name):  # add_hparams, add_image, flush, close, ...: accepted, not recorded
            return lambda *args, **kwargs: None

    real = importlib.util.find_spec("tensorboard") is not None
    if not real:
        import accelerate.tracking as tracking
        from accelerate.utils import LoggerType

        fake = types.ModuleType("tensorboardX")
        fake.SummaryWriter = RecordingWriter
        fake.__spec__ = importlib.machinery.ModuleSpec("tensorboardX", None)
        monkeypatch.setitem(sys.modules, "tensorboardX", fake)
        monkeypatch.setattr(tracking, "_available_trackers", [*tracking._available_trackers, LoggerType.TENSORBOARD])
    run_dir = tmp_path / "run"
    grpo_main([f"run_dir={run_dir}", "tracker=tensorboard", "project=myproj", "steps=1", "data.prompts_per_step=2",
               "data.group_size=2", "eval.seeds=1", "sampling.steps=2"])
    folder = run_dir / "myproj"
    assert list(folder.glob("*/hparams.yml"))  # accelerate's copy of the config, beside the event files
    if real:
        assert list(folder.glob("events.out.tfevents.*"))
    else:
        assert [w.logdir for w in writers] == [str(folder)]
        assert [s for s, _ in writers[0].scalars["eval/reward/mean"]] == [0, 1]
