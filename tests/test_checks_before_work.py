"""Every check that can run before work does: each bad input below is refused with a usage error (exit 2, one
`error:` message whose last line names the key) before anything is written to the run directory.

The recipe cases call `trainers.grpo.main`, the entry `python trainers/grpo.py` runs under `run_main`, and
format the message as `run_main` prints it; one also runs as a real subprocess (the exit status and the real
stderr). The servers' flags are checked through their own `main`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flywheel.cli import CONFIG_ERROR_EXIT, USAGE_ERRORS
from trainers.grpo import main as grpo_main

REPO = Path(__file__).resolve().parents[1]
FAST = ["tracker=none", "steps=2", "sampling.steps=2", "data.prompts_per_step=2", "data.group_size=2",
        "eval.seeds=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_diffusers_folder(root: Path, pipeline: str, transformer: str) -> Path:
    """A folder with only the JSON a family check reads: model_index.json and the transformer's config."""
    (root / "transformer").mkdir(parents=True)
    (root / "vae").mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline, "transformer": ["diffusers", transformer],
                                                       "vae": ["diffusers", "AutoencoderKL"],
                                                       "image_encoder": [None, None]}))
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer}))
    return root


def refused(argv: list[str], capsys) -> tuple[str, str]:
    """(the message `run_main` prints, the stderr printed before it) of a config the recipe refuses."""
    with pytest.raises(USAGE_ERRORS) as info:
        grpo_main(argv)
    return f"error: {info.value}", capsys.readouterr().err


def assert_nothing_written(run_dir: Path) -> None:
    assert not run_dir.exists() or not any(run_dir.iterdir()), sorted(p.name for p in run_dir.iterdir())


def assert_last_line_names(message: str, key: str) -> None:
    last = message.strip().splitlines()[-1].strip()
    assert re.match(rf"(error: )?{re.escape(key)}(=|:|\s)", last), last


CASES = {
    # id: (overrides, the key the last line names, a phrase of the reason)
    "unknown scorer": (["reward.scorers=nope:1"], "reward.scorers", "unknown scorer 'nope'"),
    "weight abc": (["reward.scorers=digit_alignment:abc"], "reward.scorers", "expected a number"),
    "weight nan": (["reward.scorers=digit_alignment:nan"], "reward.scorers", "must be finite"),
    "weight -inf": (["reward.scorers=digit_alignment:-inf"], "reward.scorers", "must be finite"),
    "empty spec": (["reward.scorers="], "reward.scorers", "reward spec is empty"),
    # A weight of 0 is ignored work: alone, the reward is constant and the run would train nothing.
    "only weight 0": (["reward.scorers=digit_alignment:0.0"], "reward.scorers",
                      "digit_alignment has weight 0, so it is scored and never rewards (the reward would be constant"),
    "one weight 0": (["reward.scorers=digit_alignment:1,jpeg_compressibility:0"], "reward.scorers",
                     "jpeg_compressibility has weight 0, so it is scored and never rewards; give a non-zero weight"),
    "remote not a url": (["reward.scorers=remote:notaurl"], "reward.scorers", "needs an address"),
    "pickscore folder unset": (["reward.scorers=pickscore"], "reward.scorers", "FLYWHEEL_PICKSCORE_PATH"),
    "clip folder missing": (["reward.scorers=clip_score:1"], "reward.scorers", "does not exist"),
    # Each of these four had no check before work: the run dir was written, then the scorer's constructor raised.
    "video clip folder missing": (["reward.scorers=clip_score_video:1"], "reward.scorers",
                                  "clip_score_video: reward 'clip_score': folder"),
    "hpsv3 folder unset": (["reward.scorers=hpsv3:1"], "reward.scorers", "set FLYWHEEL_HPSV3_PATH"),
    "hpsv3 judge folder unset": (["eval.judges=hpsv3"], "eval.judges", "hpsv3: reward 'hpsv3' needs"),
    "vlm judge without a server": (["reward.scorers=vlm_judge:1"], "reward.scorers",
                                   "vlm_judge needs the server's base URL"),
    "vlm judge server down": (["reward.scorers=vlm_judge:1", "reward.args={vlm_judge: {base_url: 'http://127.0.0.1:9/v1'}}"],
                              "reward.scorers", "vlm_judge's server is not reachable (vlm_judge could not list the "
                                                "models of http://127.0.0.1:9/v1"),
    # A judge's server was not probed: the run dir was written and the base evaluation failed on it.
    "vlm judge as a judge, server down": (["eval.judges=vlm_judge"], "eval.judges",
                                          "vlm_judge's server is not reachable (vlm_judge could not list the models "
                                          "of http://127.0.0.1:9/v1"),
    "vlm judge as a judge without a server": (["eval.judges=vlm_judge"], "eval.judges",
                                              "vlm_judge needs the server's base URL"),
    "model.path empty": (["model.path="], "model.path", "is empty"),
    "model.path missing": (["model.path=/nonexistent/toy.safetensors"], "model.path", "does not exist"),
    # Before: the toy loader's FileNotFoundError traceback; a message naming "[Errno 21] Is a directory: '.'".
    "model.path folder without the weights": (["model.path=/"], "model.path",
                                              "is a folder without toy-digits.safetensors (card 'toy-digits'"),
    # Before: the toy loader's ValueError traceback (another card's file) and the "is a folder" wording (a device).
    "model.path another toy card's weights": ([f"model.path={REPO / 'engine/toy/weights/toy-numbers.safetensors'}"],
                                              "model.path", "expected 'flywheel-toy-digits-v1'); it is a weights "
                                                            "file of card 'toy-numbers'"),
    "model.path a device": (["model.path=/dev/null"], "model.path", "is not a regular file (card 'toy-digits'"),
    "data.prompts empty": (["data.prompts="], "data.prompts", "prompt dataset '' is neither a built-in"),
    "sd3 without a folder": (["model.card=sd3"], "model.path", "loads a local diffusers folder"),
    "sampling.steps past 1000": (["sampling.steps=1001"], "sampling.steps", "at most 1000"),
    "eval.steps past 1000": (["eval.steps=5000"], "eval.steps", "at most 1000"),
    "steps 1e12": (["steps=1e12"], "steps", "at most 10_000_000"),
    # Each of these once passed the checks and failed or hung after the run dir was written: the seed overflowed
    # GRPO's step choice, torch refused the thread count, the rows' divisors were listed one by one, and the
    # evaluation built 1e30 requests.
    "seed 2**32": (["seed=4294967296"], "seed", "must be at most 2**32 - 1 = 4294967295"),
    "threads 1e30": (["threads=1e30"], "threads", "must be at most 1024 torch threads"),
    "eval.seeds 1e30": (["eval.seeds=1e30"], "eval.seeds", "must be at most 10_000 samples of each evaluation"),
    "rows 1e30": (["data.prompts_per_step=1e30"], "data.prompts_per_step",
                  "x 2 = 2000000000000000039769249677312 rollouts a step: must be at most 1_000_000"),
    "updates_per_rollout": (["data.prompts_per_step=8", "data.group_size=16", "train.minibatch_size=32",
                             "train.updates_per_rollout=3"], "train.updates_per_rollout", "use one of 1, 2, 4"),
    "gradient_accumulation": (["data.prompts_per_step=4", "data.group_size=4", "train.minibatch_size=8",
                               "train.gradient_accumulation_steps=3"], "train.gradient_accumulation_steps",
                              "does not divide the 2 minibatches"),
    # A short last minibatch would be an optimizer step on 2 rows (or outweigh the others under accumulation).
    "uneven minibatch": (["data.group_size=6", "train.minibatch_size=5"], "train.minibatch_size",
                         "does not divide the 12 rows of a step (data.prompts_per_step x data.group_size): the last "
                         "minibatch would hold 2; use one of 1, 2, 3, 4, 6, 12"),
    # Caught on the built model, still before the run dir is created:
    "lora targets empty": (["model.finetune=lora", "model.lora_targets=[]"], "model.lora_targets",
                           "model.lora_targets=[]: names no module; give module names (e.g. [qkv]) or leave it null"),
    "lora targets": (["model.finetune=lora", "model.lora_targets=[nope,qkv]"], "model.lora_targets",
                     "nope match(es) no module of the ToyDiT"),
    "height 7": (["sampling.height=7"], "sampling.height", "generates 8x8 images only"),
    "learning rate under rounding": (["train.learning_rate=1e-12"], "train.learning_rate",
                                     "so every step would change them by under 1e-07 of their size (rounding)"),
    "the same for a lora": (["model.finetune=lora", "train.learning_rate=1e-12"], "train.learning_rate",
                            "the run would train nothing"),
    "clip under adam's eps": (["train.max_grad_norm=1e-12"], "train.max_grad_norm",
                              "under AdamW's eps (1e-08), so each step moves a weight by about"),
    "lora rank, full fine-tune": (["model.lora_rank=64"], "model.lora_rank",
                                  "model.lora_rank=64 with model.finetune=full: it acts only with "
                                  "model.finetune=lora, so it would be ignored"),
    "lora targets, full fine-tune": (["model.lora_targets=[qkv]"], "model.lora_targets",
                                     "model.lora_targets=[qkv] with model.finetune=full"),
    "ema decay without the ema": (["ema.decay=0.5"], "ema.decay",
                                  "ema.decay=0.5 with ema.enabled=false: it acts only with ema.enabled=true"),
    "staleness without async": (["rollout.max_staleness=3"], "rollout.max_staleness",
                                "rollout.max_staleness=3 with rollout.asynchronous=false"),
    "project without a tracker": (["project=mine"], "project",
                                  "project=mine with tracker=none: it acts only with tracker naming a tracker, so "
                                  "it would be ignored; set tracker=wandb (or tensorboard, trackio, mlflow)"),
    "ray replicas, local backend": (["rollout.replicas=2"], "rollout.replicas",
                                    "rollout.replicas=2 with rollout.backend=local: it acts only with "
                                    "rollout.backend=ray, so it would be ignored"),
    "sync port, object store": (["rollout.backend=ray", "rollout.sync_port=30000"], "rollout.sync_port",
                                "rollout.sync_port=30000 with rollout.sync_backend=object_store: it acts only "
                                "with rollout.sync_backend=nccl or gloo"),
    "reward actor cpus, no actors": (["rollout.cpus_per_reward_actor=2"], "rollout.cpus_per_reward_actor",
                                     "rollout.cpus_per_reward_actor=2.0 with rollout.reward_actors=0: it acts "
                                     "only with rollout.reward_actors > 0"),
    "ray address, no ray": (["rollout.address=auto"], "rollout.address",
                            "rollout.address=auto with rollout.backend=local and rollout.reward_actors=0: no Ray "
                            "is started, so it would be ignored"),
    "ray retries, no ray": (["rollout.max_failures=5"], "rollout.max_failures",
                            "rollout.max_failures=5 with rollout.backend=local and rollout.reward_actors=0"),
    # model.card=toy-numbers alone kept the toy-digits prompts and reward: the run trained on the wrong task.
    "toy-numbers card, toy-digits task": (["model.card=toy-numbers"], "data.eval_prompts",
                                          "data.eval_prompts=toy-digits-heldout is the toy-digits card's task, but "
                                          "model.card=toy-numbers; for toy-numbers set data.prompts=toy-numbers "
                                          "data.eval_prompts=toy-numbers-heldout reward.scorers=number_alignment:1.0"),
    "call timeout, all in process": (["rollout.call_timeout_s=1200"], "rollout.call_timeout_s",
                                     "rollout.call_timeout_s=1200.0 with rollout.backend=local, "
                                     "rollout.asynchronous=false and rollout.reward_actors=0: everything runs in "
                                     "the trainer's process, so it would be ignored"),
    "start timeout, all in process": (["rollout.start_timeout_s=60"], "rollout.start_timeout_s",
                                      "rollout.start_timeout_s=60.0 with rollout.backend=local"),
    "call timeout 0": (["rollout.asynchronous=true", "rollout.call_timeout_s=0"], "rollout.call_timeout_s",
                       "rollout.call_timeout_s=0.0: must be a finite number of seconds > 0"),
    "start timeout inf": (["rollout.asynchronous=true", "rollout.start_timeout_s=inf"], "rollout.start_timeout_s",
                          "rollout.start_timeout_s=inf"),
    # GRPO's own switches (trainers/grpo.py GRPO_SWITCHED_KEYS)
    "window size, flow_grpo": (["train.window_size=3"], "train.window_size",
                               "train.window_size=3 with train.variant=flow_grpo: it acts only with "
                               "train.variant=mixgrpo or fast, so it would be ignored"),
    "mixgrpo's shift, fast": (["train.variant=fast", "train.window_size=1", "train.window_shift_every=5"],
                              "train.window_shift_every",
                              "train.window_shift_every=5 with train.variant=fast: it acts only with "
                              "train.variant=mixgrpo"),
    "fast's window_per, mixgrpo": (["train.variant=mixgrpo", "train.window_per=step"], "train.window_per",
                                   "train.window_per=step with train.variant=mixgrpo: it acts only with "
                                   "train.variant=fast"),
    "selection without a fraction": (["train.timestep_selection=first"], "train.timestep_selection",
                                     "train.timestep_selection=first with train.timestep_fraction=null: it acts "
                                     "only with train.timestep_fraction set (not null), so it would be ignored; "
                                     "set train.timestep_fraction or leave it out"),
    "importance cap without async": (["train.importance_cap=5"], "train.importance_cap",
                                     "train.importance_cap=5.0 with rollout.asynchronous=false"),
    # Before: accepted, and the reference forward ran and the KL was logged all the same.
    "log_kl off under a KL penalty": (["train.log_kl=false"], "train.log_kl",
                                      "train.log_kl=false with train.kl_beta=0.1: the KL penalty measures (and logs) "
                                      "the KL anyway, so it would be ignored"),
    "kl form without a kl": (["train.kl_beta=0", "train.log_kl=false", "train.kl_form=flow_grpo"], "train.kl_form",
                             "train.kl_form=flow_grpo with train.kl_beta=0 and train.log_kl=false: no KL is computed"),
    "bfloat16 full fine-tune, small rate": (["model.dtype=bfloat16", "train.learning_rate=1e-5"],
                                            "train.learning_rate", "so most of each update would round away"),
    # Before: accepted; at 1666.67 every weight was zeroed or flipped each step and the run ended at chance.
    "weight decay past 1/lr": (["train.weight_decay=5000"], "train.weight_decay",
                               "AdamW multiplies every weight by 1 - learning_rate x weight_decay = -2 each step"),
    # Before: accepted and ignored (only a remote: scorer's HTTP calls read them).
    "remote bounds without a remote scorer": (["reward.timeout_s=5"], "reward.timeout_s",
                                              "reward.timeout_s=5.0 with reward.scorers=digit_alignment:1.0: it acts "
                                              "only with reward.scorers naming a remote: scorer"),
    "float16 full fine-tune": (["model.dtype=float16"], "model.dtype",
                               "AdamW would keep its state in float16, which rounds its eps (1e-8)"),
    # Before: the first evaluation stopped the run with a traceback, after the run dir was written.
    "a judge that scores no eval prompt": (["eval.judges=ocr"], "eval.judges",
                                           "judge ocr cannot score prompt(s) 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 30 "
                                           "more of data.eval_prompts='toy-digits-heldout', that have a class"),
    "a judge named twice": (["eval.judges=jpeg_compressibility,jpeg_compressibility"], "eval.judges",
                            "names jpeg_compressibility more than once"),
    "an empty judge entry": (["eval.judges=jpeg_compressibility,"], "eval.judges", "entry 2 is empty"),
    "the card's own judge named": (["eval.judges=digit_svc"], "eval.judges",
                                   "digit_svc, digit_typicality are the toy-digits card's own judges, which every "
                                   "evaluation runs already"),
}


# Keys sampler=ode would ignore, when set (NFT's rollouts are ODE by default; GRPO refuses the ODE itself).
ODE_IGNORES = {
    "noise_level": (["sampling.noise_level=0.3"], "sampling.noise_level",
                    "sampling.noise_level=0.3 with sampling.sampler=ode: the ODE draws no noise, so it would be ignored"),
    "sde_window": (["sampling.sde_window=[0,1]"], "sampling.sde_window",
                   "sampling.sde_window=[0, 1] with sampling.sampler=ode: the ODE has no stochastic steps"),
}


@pytest.mark.parametrize("case", list(ODE_IGNORES))
def test_a_key_the_ode_would_ignore_is_refused_before_anything_is_written(case, tmp_path, capsys):
    from trainers.nft import main as nft_main

    overrides, key, reason = ODE_IGNORES[case]
    run_dir = tmp_path / "run"
    with pytest.raises(USAGE_ERRORS) as info:
        nft_main([f"run_dir={run_dir}", *FAST, "sampling.sampler=ode", *overrides])
    assert_nothing_written(run_dir)
    assert_last_line_names(f"error: {info.value}", key)
    assert reason in str(info.value).splitlines()[-1], info.value
    nft_main([f"run_dir={tmp_path / 'default'}", *FAST, "steps=1", "sampling.sampler=ode",
              "sampling.noise_level=0.7"])  # the default, which says nothing: runs


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_refused_before_anything_is_written(case, tmp_path, capsys, monkeypatch):
    overrides, key, reason = CASES[case]
    for unset in ("FLYWHEEL_PICKSCORE_PATH", "FLYWHEEL_HPSV3_PATH", "FLYWHEEL_VLM_URL", "FLYWHEEL_VLM_MODEL"):
        monkeypatch.delenv(unset, raising=False)
    monkeypatch.setenv("FLYWHEEL_CLIP_PATH", str(tmp_path / "no-clip"))
    if case == "vlm judge as a judge, server down":  # judges are built from the environment alone
        monkeypatch.setenv("FLYWHEEL_VLM_URL", "http://127.0.0.1:9/v1")
    run_dir = tmp_path / "run"
    message, _ = refused([f"run_dir={run_dir}", *FAST, *overrides], capsys)
    assert_nothing_written(run_dir)
    assert_last_line_names(message, key)
    assert reason in message.splitlines()[-1], message


@pytest.mark.parametrize("tracker,install", [("tensorboard", "`pip install tensorboard`"),
                                             ("wandb,trackio", "`pip install -e .[dashboards]`")])
def test_a_tracker_whose_package_is_not_installed_is_refused_before_anything_is_written(tracker, install, tmp_path,
                                                                                         capsys, monkeypatch):
    # Before, the run made its directory and died on a ModuleNotFoundError traceback whose advice (the dashboards
    # extra) did not bring TensorBoard.
    import importlib.util

    import flywheel.runs.tracking as tracking

    missing = {"tensorboard", "tensorboardX", "trackio"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name, *a: None if name in missing
                        else find_spec(name, *a))
    run_dir = tmp_path / "run"
    message, _ = refused([f"run_dir={run_dir}", *FAST, f"tracker={tracker}"], capsys)
    assert_nothing_written(run_dir)
    assert_last_line_names(message, "tracker")
    name = tracker.split(",")[-1]
    assert message.splitlines()[-1].strip() == (f"tracker={name} needs the {name} package, which is not installed: "
                                                f"{install}, or use tracker=wandb / tracker=none")


def test_a_folder_of_another_family_is_refused_naming_the_card_that_loads_it(tmp_path, capsys):
    flux = fake_diffusers_folder(tmp_path / "flux", "FluxPipeline", "FluxTransformer2DModel")
    message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, "model.card=sd3", f"model.path={flux}"], capsys)
    assert_nothing_written(tmp_path / "run")
    assert_last_line_names(message, "model.path")
    assert "holds a FluxPipeline (model_index.json) but card 'sd3' loads a StableDiffusion3Pipeline: use the card " \
           "'flux'" in message
    # The right pipeline with a transformer of another class, and a component listed but absent.
    odd = fake_diffusers_folder(tmp_path / "odd", "StableDiffusion3Pipeline", "FluxTransformer2DModel")
    (odd / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline",
                                                      "transformer": ["diffusers", "SD3Transformer2DModel"]}))
    message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, "model.card=sd3", f"model.path={odd}"], capsys)
    assert "transformer/config.json is a FluxTransformer2DModel, but model_index.json lists a SD3Transformer2DModel" \
        in message
    (odd / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline",
                                                      "text_encoder_3": ["transformers", "T5EncoderModel"]}))
    message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, "model.card=sd3", f"model.path={odd}"], capsys)
    assert "lacks text_encoder_3/, listed in its model_index.json" in message
    assert_nothing_written(tmp_path / "run")


def complete_sd3_folder(root: Path) -> Path:
    """A folder with every file each sd3 component's kind needs (no real weights: only the checks read it)."""
    from safetensors.torch import save_file

    classes = {"transformer": "SD3Transformer2DModel", "vae": "AutoencoderKL",
               "text_encoder": "CLIPTextModelWithProjection", "tokenizer": "CLIPTokenizer",
               "scheduler": "FlowMatchEulerDiscreteScheduler"}
    (root).mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline",
                                                       "image_encoder": [None, None],
                                                       **{k: ["diffusers", v] for k, v in classes.items()}}))
    for name, cls in classes.items():
        (root / name).mkdir()
    for name in ("transformer", "vae", "text_encoder"):
        (root / name / "config.json").write_text(json.dumps({"_class_name": classes[name]}))
        save_file({"w": torch.zeros(32, 32)}, str(root / name / "model.safetensors"))
    (root / "tokenizer" / "vocab.json").write_text("{}")
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    return root


@pytest.mark.parametrize("remove,missing", [
    ("transformer/model.safetensors", "transformer/*.safetensors (weights)"),
    ("vae/config.json", "vae/config.json"),
    ("tokenizer/vocab.json", "tokenizer/ tokenizer files"),
    ("scheduler/scheduler_config.json", "scheduler/scheduler_config.json"),
])
def test_a_diffusers_folder_missing_a_components_files_is_refused_before_loading(remove, missing, tmp_path, capsys):
    # Before, only the component folders were checked: a folder without its transformer's weights (a download
    # stopped half-way) passed, and the loader's FileNotFoundError traceback came after the run had started.
    from engine.card_folders import check_card_path

    folder = complete_sd3_folder(tmp_path / "sd3")
    check_card_path("sd3", str(folder))  # complete: passes
    (folder / remove).unlink()
    message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, "model.card=sd3", f"model.path={folder}"], capsys)
    assert_nothing_written(tmp_path / "run")
    assert_last_line_names(message, "model.path")
    assert message.splitlines()[-1].endswith(f"is incomplete: missing: {missing}" + (
        " (one of tokenizer.json, tokenizer_config.json, vocab.json, spiece.model)" if "tokenizer" in remove else "")
    ), message


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("damage,problem", [
    (cut_in_half, "unreadable: transformer/model.safetensors ({half} bytes where its header says {size}: cut short; "
                  "download it again)"),
    (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "unreadable: transformer/model.safetensors ({more} bytes "
                                                        "where its header says {size}: bytes after its data)"),
    (lambda p: p.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 212\n"),
     "unreadable: transformer/model.safetensors (not a safetensors file: a Git LFS pointer; run `git lfs pull`)"),
    (lambda p: p.write_bytes(b""), "unreadable: transformer/model.safetensors (not a safetensors file: 0 bytes, "
                                   "no header)"),
    (lambda p: p.write_bytes(p.read_bytes()[:20]), "unreadable: transformer/model.safetensors (20 bytes, cut short "
                                                   "inside its {header}-byte header; download it again)"),
    (lambda p: (p.parent / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})),
     "missing: transformer/model-00002-of-00002.safetensors (listed in model.safetensors.index.json)"),
])
def test_a_weights_file_cut_short_or_not_safetensors_is_refused_before_loading(damage, problem, tmp_path, capsys):
    # Before, a transformer file cut short by a stopped download passed every check, and diffusers' OSError
    # ("Unable to load weights from checkpoint file") came after the text encoders had loaded.
    folder = complete_sd3_folder(tmp_path / "sd3")
    size = (folder / "transformer" / "model.safetensors").stat().st_size
    assert size > 4096  # 4 KiB of float32 zeros after a header of about 80 bytes: half is past the header
    header = int.from_bytes((folder / "transformer" / "model.safetensors").read_bytes()[:8], "little")
    problem = problem.format(size=size, half=size // 2, more=size + 1, header=header)
    damage(folder / "transformer" / "model.safetensors")
    message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, "model.card=sd3", f"model.path={folder}"], capsys)
    assert_nothing_written(tmp_path / "run")
    assert_last_line_names(message, "model.path")
    assert message.splitlines()[-1].endswith(f"is incomplete: {problem}"), message


def test_a_toy_weights_file_cut_short_is_refused_before_loading(tmp_path, capsys):
    # Before: safetensors' "invalid header length" traceback from the loader.
    shipped = (REPO / "engine/toy/weights/toy-digits.safetensors").read_bytes()
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "toy-digits.safetensors").write_bytes(shipped[:len(shipped) // 2])
    message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"model.path={tmp_path / 'weights'}"], capsys)
    assert_nothing_written(tmp_path / "run")
    assert_last_line_names(message, "model.path")
    assert message.splitlines()[-1].endswith(f"cannot be loaded: toy-digits.safetensors: {len(shipped) // 2} bytes "
                                             f"where its header says {len(shipped)}: cut short; download it again")


def test_an_unreachable_remote_reward_is_refused_within_the_probe_bound(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"reward.scorers=remote:{url}"], capsys)
    assert time.monotonic() - started < 30  # the probe's own bound is 5 s; the rest is the config's checks
    assert_nothing_written(tmp_path / "run")
    assert_last_line_names(message, "reward.scorers")
    assert f"remote:{url} is not reachable" in message and "retries=0" in message


def test_a_remote_reward_that_answers_its_health_passes_the_probe(tmp_path, capsys):
    from rewards.registry import get
    from rewards.serve import ServerThread

    with ServerThread(get("digit_alignment"), "digit_alignment", "127.0.0.1", 0, None) as server:
        # Refused for another reason only (the height), so the probe of the live server passed.
        message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"reward.scorers=remote:{server.url}",
                              "sampling.height=7"], capsys)
    assert "not reachable" not in message and "sampling.height=7" in message


def test_a_remote_reward_that_wants_a_token_says_which_variable_to_set(tmp_path, capsys, monkeypatch):
    """The docs' example started the server with --token; the refusal said "not reachable ... fix the address"."""
    from rewards.registry import get
    from rewards.serve import ServerThread

    monkeypatch.delenv("FLYWHEEL_REWARD_TOKEN", raising=False)
    with ServerThread(get("digit_alignment"), "digit_alignment", "127.0.0.1", 0, "SECRET") as server:
        message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"reward.scorers=remote:{server.url}"], capsys)
        assert_nothing_written(tmp_path / "run")
        assert f"remote:{server.url} refused this client's token" in message
        assert "set FLYWHEEL_REWARD_TOKEN to the token the server was started with" in message
        monkeypatch.setenv("FLYWHEEL_REWARD_TOKEN", "SECRET")
        message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"reward.scorers=remote:{server.url}",
                              "sampling.height=7"], capsys)
    assert "token" not in message and "sampling.height=7" in message


@pytest.mark.parametrize("where", ["a file", "under /proc", "under a file", "not writable"])
def test_an_unusable_run_dir_is_refused(where, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    immutable = False
    if where == "not writable":
        (tmp_path / "ro").mkdir(mode=0o555)
        if os.geteuid() == 0:  # root writes into a mode-555 directory; an immutable one refuses even root
            immutable = subprocess.run(["chattr", "+i", str(tmp_path / "ro")], capture_output=True).returncode == 0
            if not immutable:
                pytest.skip("root writes into a read-only directory, and chattr +i is not available here")
    run_dir = {"a file": tmp_path / "file", "under /proc": Path("/proc/flywheel-run"),
               "under a file": tmp_path / "file" / "run", "not writable": tmp_path / "ro" / "run"}[where]
    try:
        message, _ = refused([f"run_dir={run_dir}", *FAST], capsys)
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(tmp_path / "ro")], check=True)
    assert_last_line_names(message, "run_dir")
    assert (tmp_path / "file").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["file"] + (["ro"] if where == "not writable" else []))


def test_a_used_run_dir_is_refused_with_the_config_before_the_model_loads(tmp_path):
    from flywheel.runs.config import ConfigError, parse_config
    from trainers.grpo import Config, validate_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("steps: 3\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError) as info:
        validate_config(parse_config(Config, [f"run_dir={run_dir}"]))
    assert_last_line_names(str(info.value), "run_dir")
    assert "holds a run that stopped after step 1, before its first checkpoint" in str(info.value)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl"]
    validate_config(parse_config(Config, [f"run_dir={run_dir}", "overwrite=true"]))  # told to: no refusal
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_folder_that_is_not_a_run_is_refused_without_suggesting_resume_or_overwrite(tmp_path):
    from flywheel.runs.config import ConfigError, parse_config
    from trainers.grpo import Config, validate_config

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for extra in ([], ["overwrite=true"]):
        with pytest.raises(ConfigError) as info:
            validate_config(parse_config(Config, [f"run_dir={folder}", *extra]))
        last = str(info.value).splitlines()[-1]
        assert "resume=" not in last and "choose a new or empty run_dir" in last.lower(), last
        assert "no config.yaml" in last
    assert (folder / "notes.txt").read_text() == "mine" and sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_more_prompts_per_step_than_prompts_is_a_warning(tmp_path, capsys):
    prompts = tmp_path / "three.txt"
    prompts.write_text("one\ntwo\nthree\n")
    _, stderr = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"data.prompts={prompts}", "data.prompts_per_step=4",
                         "steps=1e12"], capsys)
    assert f"warning: data.prompts_per_step=4 is more than the 3 prompt(s) of data.prompts='{prompts}'" in stderr
    refused([f"run_dir={tmp_path / 'run'}", *FAST, f"data.prompts={prompts}", "data.prompts_per_step=3",
             "steps=1e12"], capsys)
    assert "warning" not in capsys.readouterr().err


def test_the_command_line_exits_2_with_the_key_on_the_last_line(tmp_path):
    """One subprocess (the in-process cases above share `run_main`'s path): a check of the built model, so the
    config-time checks passed, the model loaded, and still nothing was written."""
    overrides, key = ["model.finetune=lora", "model.lora_targets=[nope]"], "model.lora_targets"
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(REPO / "trainers" / "grpo.py"), f"run_dir={run_dir}", *FAST,
                           *overrides], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == CONFIG_ERROR_EXIT, done.stderr
    assert "Traceback" not in done.stderr
    assert_last_line_names(done.stderr, key)
    assert_nothing_written(run_dir)


# ---- the servers' flags ---------------------------------------------------------------------


def server_refuses(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err  # one line: no usage block, no traceback
    return err[0]


@pytest.mark.parametrize("argv, flag", [
    (["--card", "nope"], "--card nope"),
    (["--port", "99999"], "--port 99999"),
    (["--port", "abc"], "argument --port"),
    (["--card", "sd3"], "--path"),
    (["--card", "toy-digits", "--path", "/nonexistent"], "--path /nonexistent"),
    (["--workflow", "nope"], "--workflow nope"),
    # A workflow whose other cards need folders was a traceback from the first card's load.
    (["--workflow", "image_video.t2i_i2v"], "--workflow needs card 'sd3': its folder is not set"),
    (["--workflow", "image_video.t2i_i2v", "--card-path", "sd3=/nonexistent"], "--card-path sd3=/nonexistent"),
    (["--workflow", "toy.digits_then_refine", "--card-path", "sd3=/x"], "--card-path sd3=/x: no --workflow runs"),
    (["--card-path", "toy-digits=/x"], "--card-path toy-digits=/x: toy-digits is --card"),
    (["--workflow", "image_video.t2i_i2v", "--card-path", "sd3"], "--card-path sd3: expected CARD=PATH"),
    (["--device", "banana"], "--device banana"),
    (["--max-batch", "0"], "--max-batch 0"),
    (["--max-wait-ms", "nan"], "--max-wait-ms nan"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--host", "203.0.113.7"], "--host/--port 203.0.113.7"),  # TEST-NET-3: no interface of this machine
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_engine_serve_flags_are_one_line_errors(argv, flag, capsys):
    from engine.serve import main

    assert server_refuses(main, argv, capsys).startswith(f"error: {flag}")


def test_engine_serve_loads_a_workflows_other_cards_from_card_path(tmp_path, monkeypatch):
    import engine.engine
    import engine.serve
    from tiny_models.core import build_tiny_sd3
    from tiny_models.wan_i2v import build_tiny_wan_i2v

    build_tiny_sd3(str(tmp_path / "sd3"))
    build_tiny_wan_i2v(str(tmp_path / "wan"))
    loaded = {}

    def from_card(card, path=None, device="cpu"):
        loaded[card] = path
        if len(loaded) == 3:
            raise RuntimeError("stop here")
        return object()

    monkeypatch.setattr(engine.engine.Engine, "from_card", staticmethod(from_card))
    with pytest.raises(RuntimeError, match="stop here"):
        engine.serve.main(["--card", "toy-digits", "--workflow", "image_video.t2i_i2v", "--port", "0",
                           "--card-path", f"sd3={tmp_path / 'sd3'}", "--card-path", f"wan2.1-i2v={tmp_path / 'wan'}"])
    assert loaded == {"toy-digits": None, "sd3": str(tmp_path / "sd3"), "wan2.1-i2v": str(tmp_path / "wan")}


def test_engine_serve_refuses_a_port_in_use(capsys):
    from engine.serve import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = server_refuses(main, ["--port", str(port)], capsys)
    assert line.startswith(f"error: --host/--port 127.0.0.1:{port}: cannot listen there")


@pytest.mark.parametrize("argv, flag", [
    (["--reward", "nope"], "--reward nope"),
    ([], "the following arguments are required: --reward"),
    (["--reward", "digit_alignment", "--port", "99999"], "--port 99999"),
    (["--reward", "digit_alignment", "--kwargs", "{bad"], "--kwargs {bad"),
    (["--reward", "digit_alignment", "--kwargs", "[1]"], "--kwargs [1]"),
    # A misspelt argument was a TypeError traceback from the scorer's constructor.
    (["--reward", "digit_alignment", "--kwargs", '{"paht": 1}'],
     "--kwargs {\"paht\": 1}: scorer 'digit_alignment' takes no argument 'paht'; valid arguments: weights_path"),
    (["--reward", "pickscore", "--kwargs", '{"path": "/nonexistent"}'], "--reward pickscore"),
    (["--reward", "digit_alignment", "--header-timeout-s", "0"], "--max-body-bytes/"),
])
def test_rewards_serve_flags_are_one_line_errors(argv, flag, capsys):
    from rewards.serve import main

    assert server_refuses(main, argv, capsys).startswith(f"error: {flag}")


# ---- prompt files relative to the config file ---------------------------------------------------


def test_prompt_files_in_a_config_resolve_from_the_working_directory_then_the_config_folder(tmp_path, monkeypatch):
    from flywheel.runs.config import parse_config
    from trainers.grpo import Config

    configs, elsewhere = tmp_path / "configs", tmp_path / "elsewhere"
    configs.mkdir()
    elsewhere.mkdir()
    (configs / "prompts.txt").write_text("a cat\n")
    (configs / "foo.yaml").write_text("data:\n  prompts: prompts.txt\n  eval_prompts: toy-digits-heldout\n")
    monkeypatch.chdir(elsewhere)
    cfg = parse_config(Config, ["--config", str(configs / "foo.yaml")])
    assert cfg.data.prompts == str(configs / "prompts.txt")
    assert cfg.data.eval_prompts == "toy-digits-heldout"  # a built-in name is no path
    # The working directory first: a prompts.txt there is the one meant.
    (elsewhere / "prompts.txt").write_text("a dog\n")
    assert parse_config(Config, ["--config", str(configs / "foo.yaml")]).data.prompts == "prompts.txt"
    (elsewhere / "prompts.txt").unlink()
    # A command-line value is relative to the working directory only.
    cfg = parse_config(Config, ["--config", str(configs / "foo.yaml"), "data.prompts=prompts.txt"])
    assert cfg.data.prompts == "prompts.txt"
    # Found nowhere: kept as written, for the prompts check to name.
    (configs / "foo.yaml").write_text("data:\n  prompts: missing.txt\n")
    assert parse_config(Config, ["--config", str(configs / "foo.yaml")]).data.prompts == "missing.txt"


# ---- the card's frame rule (LTX-2) ------------------------------------------------------------


def ltx2_like(temporal: int, decoder_scaling, upsample_type):
    """The attributes `LTX2Model.decoded_frames` reads: the pipeline's ratio and the VAE decoder's config."""
    config = SimpleNamespace(decoder_block_out_channels=[8] * len(upsample_type),
                             decoder_spatio_temporal_scaling=decoder_scaling, upsample_type=upsample_type)
    return SimpleNamespace(pipe=SimpleNamespace(vae_temporal_compression_ratio=temporal),
                           vae=SimpleNamespace(config=config))


def test_ltx2_decoded_frames_follow_the_vae_config():
    from engine.families.ltx2 import LTX2Model

    released = ltx2_like(8, (True, True, True), ("spatiotemporal",) * 3)
    assert LTX2Model.decoded_frames(released, 9)[:2] == (9, 9)
    assert LTX2Model.decoded_frames(released, None)[:2] == (121, 121)
    # The tiny folder's VAE: a scaling counted by the encoder's ratio but done in space only.
    tiny = ltx2_like(2, (True,), ("spatial",))
    asked, got, why = LTX2Model.decoded_frames(tiny, 9)
    assert (asked, got) == (9, 5)
    assert "decoder upsamples time by 1, so 9 frames decode to 5" in why
    assert LTX2Model.decoded_frames(ltx2_like(4, (True, True), ("temporal", "spatial")), 9)[:2] == (9, 5)


def test_a_video_card_that_decodes_other_frames_says_why_naming_sampling_frames(capsys):
    from engine.families.ltx2 import LTX2Model
    from flywheel.recipe.preflight import check_built_model
    from flywheel.runs.config import ConfigError

    class Model:
        decoded_frames = LTX2Model.decoded_frames

        def __init__(self):
            self.pipe, self.vae = ltx2_like(2, (True,), ("spatial",)).pipe, ltx2_like(2, (True,), ("spatial",)).vae

        def latent_shape(self, height, width, frames):
            if (frames - 1) % 2:
                raise ValueError("ltx2: frames must be 2k+1 (this folder's VAE compresses time by 2): 3, 5, ...")
            return (1,)

    cfg = SimpleNamespace(workflow=SimpleNamespace(name=None),
                          sampling=SimpleNamespace(height=None, width=None, frames=9))
    check_built_model(cfg, Model())
    assert capsys.readouterr().err.startswith("warning: sampling.frames=9: this folder's video VAE keeps")
    cfg.sampling.frames = 10
    with pytest.raises(ConfigError, match=r"sampling.frames=10: ltx2: frames must be 2k\+1"):
        check_built_model(cfg, Model())


def test_prompts_the_reward_cannot_score_are_refused_before_anything_is_written(tmp_path, capsys):
    """digit_alignment scores NaN (masked) for a prompt naming no digit: a dataset of only such prompts used to
    run until reward.max_masked_steps stopped it (and the evaluation's judges crashed on no class at all)."""
    cats = tmp_path / "cats.txt"
    cats.write_text("a cat\na dog\n")
    run_dir = tmp_path / "run"
    message, _ = refused([f"run_dir={run_dir}", *FAST, f"data.prompts={cats}"], capsys)
    assert_nothing_written(run_dir)
    assert_last_line_names(message, "data.prompts")
    assert (f"data.prompts='{cats}': reward digit_alignment can score none of its 2 prompt(s), so every sample "
            "would be masked; each prompt needs a digit") in message
    assert "(prompt 1 is 'a cat')" in message
    # The same dataset with a reward that reads no digit trains, and its evaluation has no per-class judge keys.
    from trainers.grpo import main as grpo_main

    grpo_main([f"run_dir={tmp_path / 'jpeg'}", *FAST, "steps=1", f"data.prompts={cats}", f"data.eval_prompts={cats}",
               "reward.scorers=jpeg_compressibility:1.0"])
    rows = [json.loads(line) for line in (tmp_path / "jpeg" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/judge/digit_svc/mean" in rows[-1] and "eval/judge/digit_svc/min_class" not in rows[-1]


def test_a_remote_reward_checks_the_prompts_on_its_server_as_an_in_process_one_does(tmp_path, capsys):
    """remote:<url> of the digit reward refuses a dataset it can score none of (POST /coverage), names a row it
    refuses, and says nothing of a reward that does not tell (jpeg). Before, every sample of such a run was
    masked until reward.max_masked_steps stopped it."""
    from rewards.registry import get
    from rewards.serve import ServerThread

    cats = tmp_path / "cats.txt"
    cats.write_text("a cat\na dog\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "digit": 12}\n')
    with ServerThread(get("digit_alignment"), "digit_alignment", "127.0.0.1", 0, None) as digits, \
            ServerThread(get("jpeg_compressibility"), "jpeg_compressibility", "127.0.0.1", 0, None) as jpeg:
        remote = f"remote:{digits.url}"
        message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"reward.scorers={remote}",
                              f"data.prompts={cats}"], capsys)
        assert_nothing_written(tmp_path / "run")
        assert_last_line_names(message, "data.prompts")
        assert (f"data.prompts='{cats}': reward {remote} can score none of its 2 prompt(s), so every sample would "
                "be masked; each prompt needs a digit") in message
        message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"reward.scorers={remote}",
                              f"data.prompts={bad}"], capsys)
        assert "metadata[0]['digit'] = 12 is out of range" in message and "HTTP 400" in message
        # The server's verdict, row by row, is the in-process scorer's.
        client = get(remote)
        prompts = ["a handwritten 7", "a cat", "anything"]
        metadata = [{}, {}, {"digit": 3}]
        assert client.prompt_needs == type(get("digit_alignment")).prompt_needs
        assert client.scored_rows(prompts, metadata) == [True, False, True]
        assert get(f"remote:{jpeg.url}").scored_rows(prompts, metadata) is None  # jpeg does not say
        message, _ = refused([f"run_dir={tmp_path / 'run'}", *FAST, f"reward.scorers=remote:{jpeg.url}",
                              f"data.prompts={cats}", "sampling.height=7"], capsys)
        assert "can score none" not in message and "sampling.height=7" in message


def test_prompts_the_reward_cannot_score_among_others_are_named_in_a_warning(tmp_path, capsys):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "a handwritten 7"}\n{"prompt": "a cat"}\n{"prompt": "anything", "digit": 3}\n')
    from trainers.grpo import main as grpo_main

    grpo_main([f"run_dir={tmp_path / 'run'}", *FAST, "steps=1", f"data.prompts={mixed}"])
    assert (f"warning: data.prompts='{mixed}': reward digit_alignment cannot score prompt(s) 2 of 3, whose samples "
            "it masks") in capsys.readouterr().err
    with pytest.raises(USAGE_ERRORS, match=r"data.prompts=.*reward digit_alignment: metadata\[0\]\['digit'\] = 12 "
                                           r"is out of range"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "x", "digit": 12}\n')
        grpo_main([f"run_dir={tmp_path / 'bad'}", *FAST, f"data.prompts={bad}"])
    assert_nothing_written(tmp_path / "bad")


@pytest.mark.parametrize("recipe,why", [("dpo", "it pairs samples by their total reward"),
                                        ("draft", "the loss is the reward itself, differentiated")])
def test_advantage_keys_a_recipe_without_advantages_would_ignore_are_refused(recipe, why, tmp_path):
    import importlib

    main = importlib.import_module(f"trainers.{recipe}").main
    run_dir = tmp_path / "run"
    with pytest.raises(USAGE_ERRORS) as info:
        main([f"run_dir={run_dir}", *FAST, "advantage.clip_max=2"])
    assert_nothing_written(run_dir)
    assert_last_line_names(f"error: {info.value}", "advantage.clip_max")
    assert f"advantage.clip_max=2.0: {recipe.upper() if recipe == 'dpo' else 'DRaFT'} trains on no advantages ({why})" \
        in str(info.value)
    main([f"run_dir={tmp_path / 'default'}", *FAST, "steps=1", "advantage.clip_max=5.0"])  # the default: runs


def test_draft_refuses_the_flat_steps_stop_it_never_reaches(tmp_path):
    from trainers.draft import main

    with pytest.raises(USAGE_ERRORS) as info:
        main([f"run_dir={tmp_path / 'run'}", *FAST, "reward.max_flat_steps=2"])
    assert_nothing_written(tmp_path / "run")
    assert str(info.value).splitlines()[-1].strip().startswith(
        "reward.max_flat_steps=2: DRaFT trains on every valid sample's reward, not on the spread within a group")


@pytest.mark.parametrize("overrides", [
    ["train.variant=mixgrpo", "train.window_size=1", "train.window_shift_every=1"],
    ["train.variant=fast", "train.window_size=1", "train.window_per=step"],
    ["train.timestep_fraction=0.5", "train.timestep_selection=first"],
    ["train.kl_beta=0", "train.log_kl=true", "train.kl_form=flow_grpo"],
])
def test_grpo_switched_keys_with_their_switch_on_run(overrides, tmp_path):
    grpo_main([f"run_dir={tmp_path / 'run'}", *FAST, "steps=1", *overrides])
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


SWITCHED = [
    # (recipe, overrides, the refused key's phrase)
    ("nft", ["train.eta_max=0", "train.eta_rate=0.01"],
     "train.eta_rate=0.01 with train.eta_max=0.0: it acts only with train.eta_max > 0, so it would be ignored; "
     "set train.eta_max > 0 or leave it out"),
    ("nft", ["train.eta_max=0", "train.eta_flat_steps=3"], "train.eta_flat_steps=3 with train.eta_max=0.0"),
    ("awm", ["train.time_shift=2"], "train.time_shift=2.0 with train.time_sampling=schedule: it acts only with "
                                    "train.time_sampling=uniform"),
    ("awm", ["train.time_sampling=uniform", "train.skip_first_step=false"],
     "train.skip_first_step=false with train.time_sampling=uniform: it acts only with train.time_sampling=schedule"),
    ("awm", ["train.weighting=t", "train.ghuber_power=0.5"], "train.ghuber_power=0.5 with train.weighting=t"),
    ("awm", ["train.anchor_beta=0", "train.anchor_decay=0.5"],
     "train.anchor_decay=0.5 with train.anchor_beta=0.0: it acts only with train.anchor_beta > 0"),
    ("draft", ["train.refl_window=[0.5,1.0]"], "train.refl_window=[0.5,1.0] with train.mode=draft: it acts only "
                                               "with train.mode=refl"),
    ("draft", ["train.mode=refl", "train.truncation_steps=2"], "train.truncation_steps=2 with train.mode=refl"),
    ("draft", ["train.anchor_decay_ramp=0.01"], "train.anchor_decay_ramp=0.01 with train.anchor_beta=0.0"),
    ("dpo", ["train.kl_beta=0", "train.kl_rows=pairs"],
     "train.kl_rows=pairs with train.kl_beta=0.0: it acts only with train.kl_beta > 0"),
]


@pytest.mark.parametrize("recipe, overrides, phrase", SWITCHED, ids=[" ".join(c[1]) for c in SWITCHED])
def test_a_recipes_key_its_switch_leaves_unused_is_refused_before_anything_is_written(recipe, overrides, phrase,
                                                                                      tmp_path):
    import importlib

    main = importlib.import_module(f"trainers.{recipe}").main
    run_dir = tmp_path / "run"
    with pytest.raises(USAGE_ERRORS) as info:
        main([f"run_dir={run_dir}", *FAST, *overrides])
    assert_nothing_written(run_dir)
    assert phrase in str(info.value), info.value


@pytest.mark.parametrize("recipe, overrides", [
    ("nft", ["train.eta_max=0.2", "train.eta_rate=0.01", "train.eta_flat_steps=1"]),
    ("awm", ["train.time_sampling=uniform", "train.time_shift=2", "train.uniform_t_min=0.1"]),
    ("awm", ["train.time_sampling=uniform", "train.anchor_beta=0.5", "train.anchor_decay=0.5"]),
    ("draft", ["train.mode=refl", "train.refl_window=[0.5,1.0]"]),
    ("draft", ["train.anchor_beta=0.1", "train.anchor_decay_ramp=0.01"]),
    ("dpo", ["train.kl_beta=0.5", "train.kl_rows=pairs"]),
])
def test_the_same_keys_with_their_switch_on_run(recipe, overrides, tmp_path):
    import importlib

    importlib.import_module(f"trainers.{recipe}").main([f"run_dir={tmp_path / 'run'}", *FAST, "steps=1", *overrides])
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_switched_key_at_the_recipes_own_default_is_not_refused(tmp_path):
    """DPO keeps an EMA at decay 0.85 by default: turning the EMA off leaves that decay, which says nothing."""
    from trainers.dpo import main as dpo_main

    dpo_main([f"run_dir={tmp_path / 'run'}", *FAST, "steps=1", "ema.enabled=false"])
    with pytest.raises(USAGE_ERRORS, match=r"ema.decay=0.5 with ema.enabled=false"):
        dpo_main([f"run_dir={tmp_path / 'other'}", *FAST, "ema.enabled=false", "ema.decay=0.5"])


# Values each recipe once accepted, to fail or hang after the run dir was written (found by trying nan, inf, -1, 0
# and 1e30 on every numeric key): the refusal names the key and its range.
OUT_OF_RANGE = [
    ("awm", ["train.timestep_fraction=inf"], "train.timestep_fraction=inf: must be a finite number"),
    ("dpo", ["train.timesteps_per_pair=1e30"], "train.timesteps_per_pair=1000000000000000019884624838656: must be "
                                               "an integer in [1, 1000]"),
    ("draft", ["train.lv_samples=1e30"], "train.lv_samples=1000000000000000019884624838656: must be an integer in "
                                         "[0, 1000]"),
    ("nft", ["sampling.height=1e30"], "sampling.height=1000000000000000019884624838656: must be at most 16384 (the "
                                      "engine's bound)"),
    ("nft", ["sampling.frames=5000"], "sampling.frames=5000: must be at most 4096 (the engine's bound)"),
    ("grpo", ["rollout.reward_actors=1e30"], "rollout.reward_actors=1000000000000000019884624838656: must be at "
                                             "most 1024"),
    # Finite in Python, inf in float32: "the gradient norm is nan" at step 1, after the run dir was written.
    ("grpo", ["train.kl_beta=1e300"], "train.kl_beta=1e+300: must be a finite number of at most 3.403e+38 in "
                                      "magnitude (float32's range"),
    ("nft", ["train.learning_rate=-1e39"], "train.learning_rate=-1e+39: must be a finite number of at most"),
]


@pytest.mark.parametrize("recipe, overrides, phrase", OUT_OF_RANGE, ids=[" ".join(c[1]) for c in OUT_OF_RANGE])
def test_a_value_out_of_a_recipes_range_is_refused_before_anything_is_written(recipe, overrides, phrase, tmp_path):
    import importlib

    main = importlib.import_module(f"trainers.{recipe}").main
    run_dir = tmp_path / "run"
    with pytest.raises(USAGE_ERRORS) as info:
        main([f"run_dir={run_dir}", *FAST, *overrides])
    assert_nothing_written(run_dir)
    assert any(line.strip().startswith(phrase) for line in str(info.value).splitlines()), info.value


def test_async_rollouts_on_several_trainer_processes_are_refused_before_the_run_dir(tmp_path, capsys, monkeypatch):
    # The engine process refused a second trainer process only once it was built, after the run dir was written.
    monkeypatch.setenv("WORLD_SIZE", "2")
    run_dir = tmp_path / "run"
    message, _ = refused([f"run_dir={run_dir}", *FAST, "rollout.asynchronous=true"], capsys)
    assert_nothing_written(run_dir)
    assert_last_line_names(message, "rollout.asynchronous")
    assert "needs a single trainer process (the engine process takes the other cores); this launch has 2" in message


@pytest.mark.parametrize("env, overrides, key, reason", [
    # Each was raised once the run dir was written (the Ray pool's build, the engine process's shared buffer).
    ({"WORLD_SIZE": "2"}, ["rollout.backend=ray", "rollout.replicas=2"], "rollout.backend",
     "rollout.backend=ray with 2 trainer processes needs one Ray cluster for all of them"),
    ({"WORLD_SIZE": "2"}, ["rollout.backend=ray", "rollout.address=auto", "rollout.replicas=3"], "rollout.replicas",
     "rollout.replicas=3 must be divisible by the number of trainer processes (2)"),
    ({"ACCELERATE_USE_FSDP": "true"}, ["rollout.asynchronous=true"], "rollout.asynchronous",
     "rollout.asynchronous=true with an FSDP launch"),
    # A local Ray instance cannot place these: the pool waited start_timeout_s (600 s) after the run dir was
    # written; nccl on CPU torch was an AttributeError traceback at the pool's build.
    ({}, ["rollout.backend=ray", "rollout.replicas=4096"], "rollout.replicas",
     "rollout.replicas=4096 x cpus_per_replica=1, gpus_per_replica=0 (and 0 reward actor(s)) ask a local Ray "
     "instance for 4096 CPU(s) and 0 GPU(s); this machine has"),
    ({}, ["rollout.backend=ray", "rollout.gpus_per_replica=1"], "rollout.replicas",
     "ask a local Ray instance for 1 CPU(s) and 1 GPU(s)"),
    ({}, ["rollout.backend=ray", "rollout.sync_backend=nccl"], "rollout.sync_backend",
     "rollout.sync_backend=nccl needs CUDA GPUs (NCCL)"),
    # ray.init retried an address nobody serves without end; a malformed one was a ValueError traceback.
    ({}, ["rollout.backend=ray", "rollout.address=127.0.0.1:1"], "rollout.address",
     "rollout.address='127.0.0.1:1': nothing answers there"),
    ({}, ["rollout.backend=ray", "rollout.address=bogus"], "rollout.address",
     "rollout.address='bogus': must be auto, host:port"),
])
def test_layouts_that_need_the_launch_to_fit_are_refused_before_the_run_dir(env, overrides, key, reason, tmp_path,
                                                                             capsys, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    message, _ = refused([f"run_dir={run_dir}", *FAST, *overrides], capsys)
    assert_nothing_written(run_dir)
    # The line that gives the reason names the key (rollout.address=auto adds its own line where no cluster runs).
    said = [line for line in message.splitlines() if reason in line]
    assert said, message
    assert_last_line_names(said[0], key)


@pytest.mark.parametrize("discovered, reason", [
    (None, "rollout.address='auto': no running Ray cluster on this machine (no RAY_ADDRESS, no cluster from `ray "
           "start`); start one with `ray start --head`"),
    ("127.0.0.1:1", "rollout.address='auto' (Ray found 127.0.0.1:1): nothing answers there"),  # a stale record
])
def test_rollout_address_auto_with_no_cluster_to_join_is_refused_before_the_run_dir(discovered, reason, tmp_path,
                                                                                    capsys, monkeypatch):
    """ray.init(address="auto") with no cluster was a ConnectionError traceback at the pool's build, after the
    run dir was written. Ray's discovery is made to see only `discovered`: another test may run a cluster on
    this machine at the same time."""
    import ray._private.services as ray_services
    import ray._private.utils as ray_utils

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(ray_utils, "read_ray_address", lambda temp_dir=None: discovered)
    run_dir = tmp_path / "run"
    message, _ = refused([f"run_dir={run_dir}", *FAST, "rollout.backend=ray", "rollout.address=auto"], capsys)
    assert_nothing_written(run_dir)
    assert_last_line_names(message, "rollout.address")
    assert reason in message.splitlines()[-1], message


@pytest.mark.parametrize("recipe, args, said", [
    ("dpo", [], "DPO pairs each group within each process's share"),
    ("nft", ["train.downsample_fraction=0.75"], "train.downsample_fraction keeps the max-variance subset of each "
                                                "process's share of a group"),
])
def test_a_launch_that_splits_groups_across_processes_is_said_before_work(recipe, args, said, capsys, monkeypatch):
    from flywheel.runs.config import parse_config
    # A recipe that works on a process's share of a group (DPO's pairs, NFT's down-sampling) said nothing when a
    # launch split the groups (4 x 6 rows on 3 processes: 8 rows each).
    import importlib

    module = importlib.import_module(f"trainers.{recipe}")
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    split = ["data.prompts_per_step=4", "data.group_size=6", *args]
    monkeypatch.setenv("WORLD_SIZE", "3")
    module.validate_config(parse_config(module.Config, split))
    err = capsys.readouterr().err
    assert "warning: data.group_size=6 on 3 processes of 8 rows each: groups are split across processes" in err
    assert said in err
    for world, overrides in (("2", split), ("1", split), ("3", ["data.prompts_per_step=6", "data.group_size=4", *args])):
        monkeypatch.setenv("WORLD_SIZE", world)  # 12 rows of 2 groups; one process; 8 rows of 2 groups
        module.validate_config(parse_config(module.Config, overrides))
        assert "groups are split" not in capsys.readouterr().err


def test_the_trained_reward_named_as_a_judge_is_warned_about(tmp_path, capsys):
    from trainers.grpo import Config, validate_config
    from flywheel.runs.config import parse_config

    validate_config(parse_config(Config, [f"run_dir={tmp_path / 'run'}", *FAST, "eval.judges=digit_alignment"]))
    assert ("warning: eval.judges names digit_alignment, which reward.scorers trains on: a judge is meant to be "
            "independent of the reward") in capsys.readouterr().err
    validate_config(parse_config(Config, [f"run_dir={tmp_path / 'run'}", *FAST, "eval.judges=jpeg_compressibility"]))
    assert "trains on" not in capsys.readouterr().err


def test_a_judge_that_scores_some_unclassed_eval_prompts_is_warned_about(tmp_path, capsys):
    from trainers.grpo import Config, validate_config
    from flywheel.runs.config import parse_config

    # Prompts with no class (no digit: the toy-digits judges give them none), one with quoted text: ocr scores one
    # of the two, which is said; a prompt with a class it could not score is refused (the case above).
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "a sign that says \\"HI\\""}\n{"prompt": "a cat"}\n')
    validate_config(parse_config(Config, [f"run_dir={tmp_path / 'run'}", *FAST, "eval.judges=ocr",
                                          "reward.scorers=jpeg_compressibility:1", f"data.prompts={mixed}",
                                          f"data.eval_prompts={mixed}"]))
    assert (f"warning: eval.judges='ocr': judge ocr cannot score 1 of the 2 prompt(s) of data.eval_prompts="
            f"'{mixed}'") in capsys.readouterr().err


def test_a_weight_decay_that_takes_a_share_of_every_weight_each_step_is_warned_about(tmp_path, capsys):
    from trainers.grpo import Config, validate_config
    from flywheel.runs.config import parse_config

    validate_config(parse_config(Config, [f"run_dir={tmp_path / 'run'}", *FAST, "train.weight_decay=100",
                                          "train.learning_rate=1e-3"]))
    assert ("warning: train.weight_decay=100 with train.learning_rate=0.001: AdamW's decay takes 10.0% of every "
            "weight each step") in capsys.readouterr().err
    validate_config(parse_config(Config, [f"run_dir={tmp_path / 'run'}", *FAST, "train.weight_decay=0.1"]))
    assert "decay takes" not in capsys.readouterr().err
