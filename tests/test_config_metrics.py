"""Every shipped config that runs on a CPU logs the same metrics.jsonl, bit for bit, as when its golden file
was recorded: 3 steps and an evaluation, every key but the wall-clock ones (time/*, *_s). Bit for bit under
FLYWHEEL_EXACT_GOLDENS=1 on the recording machine's kernel path; by default within a rounding bound (`exact`).

The golden rows are the contract a refactor keeps: a change that moves a number, renames a key or drops one
fails here, naming the config, the step and the key. A change meant to move numbers re-records them:

    OMP_NUM_THREADS=1 python tests/test_config_metrics.py --record [config ...]

and says why in its commit. The runs are shrunk (2 prompts x 4 samples, one evaluation seed) so that all of
them fit the CI budget; every algorithm, sampler and model key of the config is kept. Configs that need a
model folder of their own (SD3, FLUX, Qwen-Image, Wan, LTX-2) are not run here: tests/test_families*.py cover
them on tiny models.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "config_metrics.json"
OVERRIDES = ["steps=3", "eval.every=3", "sample_every=3", "save_every=3", "data.prompts_per_step=2",
             "data.group_size=4", "eval.seeds=1", "tracker=none", "threads=1"]
# Keys renamed on purpose since the goldens were recorded, per recipe: old -> new (the values must still match).
# Issue 24: a velocity MSE to the reference (or to AWM's EMA anchor) is no longer logged as a KL; GRPO's "kl",
# a Gaussian KL, keeps its name. (NFT's and DPO's are renamed too; every config of theirs that logs one was
# recorded after the rename.)
RENAMED: dict[str, dict[str, str]] = {
    "awm": {"kl": "ref_mse", "anchor_kl": "anchor_mse"},
}


def cpu_configs() -> list[Path]:
    """The shipped configs that name no model folder: those run on the built-in toy cards."""
    import yaml

    def on_toy_card(path: Path) -> bool:
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        return str(model.get("card", "toy-digits")).startswith("toy-") and not model.get("path")

    return sorted(p for p in (ROOT / "configs").glob("*.yaml") if on_toy_card(p))


def recipe_of(config: Path) -> Path:
    """The recipe a config is launched with, from its `trainers/<recipe>.py` usage line."""
    found = re.search(r"trainers/(\w+)\.py", config.read_text())
    assert found, f"{config.name} names no trainers/<recipe>.py usage line"
    return ROOT / "trainers" / f"{found.group(1)}.py"


def cpu_capability() -> str:
    """Which of ATen's CPU kernel paths this machine takes: another one rounds differently (test_toy_numbers)."""
    return torch.backends.cpu.get_cpu_capability()


def exact(recorded: dict) -> bool:
    """Whether to demand the goldens bit for bit: only when asked (FLYWHEEL_EXACT_GOLDENS=1) on a CPU of the
    recorded kernel path. The same capability is not enough by default: CI machines that report the recorder's
    AVX2 still rounded the toy's step-0 evaluation differently, by about 1e-6 relative (MKL and oneDNN pick
    kernels by CPU model and vendor, not only by instruction set), so the default is the rounding bound."""
    return os.environ.get("FLYWHEEL_EXACT_GOLDENS") == "1" and cpu_capability() == recorded["cpu_capability"]


def run_config(config: Path, run_dir: Path, overrides: list[str] = OVERRIDES, recipe: Path | None = None,
               stderr: list | None = None) -> list[dict]:
    """The config's metrics rows as logged (wall-clock keys left out); `stderr` collects the run's stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(recipe or recipe_of(config)), "--config", str(config), *overrides,
                           f"run_dir={run_dir}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{config.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    if stderr is not None:
        stderr.append(proc.stderr)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [deterministic(row) for row in rows]


def run_configs_in_one_process(configs: list[Path], out: Path) -> None:
    """Each config's run, one after the other in one fresh process (`--run-all`): the imports and the judges' fit
    are paid once, ~1 s a config after the first instead of ~7 s in a process each. The rows must still be the
    goldens, so nothing one run leaves in the process (a cache, a seed, a thread count) may move the next one's.
    A config whose run raises leaves its traceback in <out>/<config>/error.txt and the others still run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--run-all", str(out), *(str(c) for c in configs)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"--run-all: exit {proc.returncode}\n{proc.stderr[-3000:]}"


def _run_all(out: Path, configs: list[Path]) -> None:
    import importlib
    import traceback

    for config in configs:
        run_dir = out / config.stem
        try:
            main = importlib.import_module(f"trainers.{recipe_of(config).stem}").main
            main(["--config", str(config), *OVERRIDES, f"run_dir={run_dir}"])
        except BaseException:  # noqa: BLE001  the test of this config reports it; the next ones still run
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "error.txt").write_text(traceback.format_exc())


def deterministic(row: dict, renamed: dict[str, str] | None = None) -> dict:
    """A metrics row without its wall-clock figures (time/* and every *_s key: seconds of sync, busy time), with
    `renamed`'s keys under their new names."""
    renamed = renamed or {}
    return {renamed.get(k, k): v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_s"))}


def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def test_the_goldens_cover_every_cpu_config():
    assert sorted(golden()["configs"]) == sorted(p.name for p in cpu_configs())
    assert len(cpu_configs()) >= 10  # the toy configs of every recipe


def test_the_renames_are_per_recipe_and_name_keys_the_goldens_hold():
    """Each recipe's renamed keys are in its configs' goldens (the map is not stale), and GRPO's kl, a Gaussian
    KL, is not renamed: only the velocity MSEs of nft, awm and dpo are."""
    recorded, keys = golden()["configs"], {}
    for config in cpu_configs():
        keys.setdefault(recipe_of(config).stem, set()).update(k for row in recorded[config.name] for k in row)
    for recipe, renamed in RENAMED.items():
        assert set(renamed) <= keys[recipe], (recipe, sorted(set(renamed) - keys[recipe]))
    assert "grpo" not in RENAMED and "kl" in keys["grpo"]
    assert deterministic({"kl": 1.0, "time/step_s": 2.0}, RENAMED["awm"]) == {"ref_mse": 1.0}


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory) -> Path:
    """Every CPU config's run dir, all run in one process."""
    out = tmp_path_factory.mktemp("config_runs")
    run_configs_in_one_process(cpu_configs(), out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", cpu_configs(), ids=lambda p: p.stem)
def test_config_logs_its_golden_metrics(config, config_runs):
    recorded = golden()
    expected = recorded["configs"][config.name]
    error = config_runs / config.stem / "error.txt"
    assert not error.exists(), f"{config.name}: the run raised\n{error.read_text()[-3000:] if error.exists() else ''}"
    got = [deterministic(json.loads(line)) for line in
           (config_runs / config.stem / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [row["step"] for row in got] == [row["step"] for row in expected]
    renamed = RENAMED.get(recipe_of(config).stem, {})
    for want, have in zip(expected, got):
        want = deterministic(want, renamed)
        assert sorted(have) == sorted(want), (f"{config.name} step {want['step']}: keys differ: missing "
                                             f"{sorted(set(want) - set(have))}, new {sorted(set(have) - set(want))}")
        if exact(recorded):
            differ = {k: (want[k], have[k]) for k in want if have[k] != want[k]}
        else:  # another CPU's kernels round differently: the same run within a rounding bound
            differ = {k: (want[k], have[k]) for k in want if not _close(want[k], have[k])}
        assert not differ, f"{config.name} step {want['step']}: {differ}"


def old_named(config: Path, out: Path) -> Path:
    """The config with every key that moved in issue 24 under its old name, flat (dotted) as a file may give it."""
    import yaml

    from flywheel.config.aliases import ALIASES

    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]

    old_of = {new: old for old, new in ALIASES.items()}
    keys = {old_of.get(k, k): v for k, v in flat(yaml.safe_load(config.read_text()))}
    out.write_text(yaml.safe_dump(keys, sort_keys=False))
    return out


@pytest.mark.slow
def test_old_key_names_log_the_same_golden_metrics(tmp_path):
    """The config and the overrides as they were when the goldens were recorded (the old key names, which the
    golden file keeps under `overrides`): the same rows bit for bit, each old name warned about once."""
    recorded, config = golden(), ROOT / "configs" / "toy_awm.yaml"
    old_config = old_named(config, tmp_path / config.name)
    assert {"rewards", "train.global_std"} <= set(yaml_keys(old_config))
    assert {"eval_every=3", "sampling.eval_seeds=1"} <= set(recorded["overrides"])
    stderr = []
    got = run_config(old_config, tmp_path / "run", recorded["overrides"], recipe_of(config), stderr)
    want = [deterministic(row, RENAMED["awm"]) for row in recorded["configs"][config.name]]
    if exact(recorded):
        assert got == want
    else:  # another CPU's kernels round differently
        assert [sorted(r) for r in got] == [sorted(r) for r in want]
        assert all(_close(w[k], g[k]) for w, g in zip(want, got) for k in w)
    for old, new in (("rewards", "reward.scorers"), ("eval_every", "eval.every"),
                     ("train.global_std", "advantage.global_std"), ("sampling.eval_seeds", "eval.seeds")):
        assert stderr[0].count(f"config key {old!r}") == 1 and f"is now {new!r}" in stderr[0], old


def yaml_keys(path: Path) -> list[str]:
    import yaml

    return list(yaml.safe_load(path.read_text()))


def _close(a, b) -> bool:
    """Equal up to kernel rounding (1e-4 of the value, or absolute below 1): the CI machines' differences are about
    1e-6 after 3 steps, while a changed formula, key or seed moves a toy metric by far more."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-4 * max(1.0, abs(a))
    return a == b


def record(names: list[str]) -> None:
    import tempfile

    data = golden() if GOLDEN.exists() else {"configs": {}}
    data["cpu_capability"] = cpu_capability()
    # The recorded overrides keep the key names they were first recorded with (the old names, which
    # test_old_key_names_log_the_same_golden_metrics checks); a change to OVERRIDES means re-recording every config.
    data.setdefault("overrides", OVERRIDES)
    for config in cpu_configs():
        if names and config.name not in names and config.stem not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            data["configs"][config.name] = run_config(config, Path(tmp) / "run")
        print(f"recorded {config.name}: {len(data['configs'][config.name])} rows", flush=True)
    data["configs"] = {k: data["configs"][k] for k in sorted(data["configs"])}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-all"] and len(sys.argv) > 2:
        _run_all(Path(sys.argv[2]), [Path(c) for c in sys.argv[3:]])
    elif sys.argv[1:2] == ["--record"]:
        record(sys.argv[2:])
    else:
        sys.exit("usage: python tests/test_config_metrics.py --record [config ...]")
