"""The pretraining scripts refuse values no training can use, with usage and one error line naming the flag,
exit 2, before any step: `--epochs -1` trained nothing and then refused on accuracy, `--batch-size 0` was a
traceback from range(), a directory as `--out` failed only after every epoch had run."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from engine.toy.pretrain import CARD_DEFAULTS, pretrain

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(call, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        call()
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, said", [
    (["--epochs", "-1"], "--epochs -1: must be a whole number >= 1"),
    (["--batch-size", "0"], "--batch-size 0: must be a whole number >= 1"),
    (["--lr", "nan"], "--lr nan: must be a finite number > 0"),
    (["--lr", "0"], "--lr 0.0: must be a finite number > 0"),
])
def test_the_classifier_script_refuses_bad_values_before_training(argv, said, tmp_path, capsys):
    out = tmp_path / "digits.safetensors"
    last = refused(lambda: script("train_digit_classifier").main([*argv, "--out", str(out)]), capsys)
    assert last.endswith(f": error: {said}"), last  # after the program's name
    assert not out.exists()


def test_the_classifier_script_refuses_a_directory_as_out(tmp_path, capsys):
    last = refused(lambda: script("train_digit_classifier").main(["--out", str(tmp_path)]), capsys)
    assert last.endswith(f": error: --out {tmp_path} is a directory: give the path of the safetensors file to "
                         f"write"), last


@pytest.mark.parametrize("argv, said", [
    (["--steps", "0"], "--steps 0: must be a whole number >= 1"),
    (["--label-noise", "1.5"], "--label-noise 1.5: must be in [0, 1]"),
    (["--prompt-dropout", "1"], "--prompt-dropout 1.0: must be in [0, 1)"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be a finite number >= 0"),
    (["--threads", "0", "--lr", "-1"], "--threads 0: must be a whole number >= 1; --lr -1.0: must be a finite"),
])
@pytest.mark.parametrize("card", ["toy-digits", "toy-numbers"])  # pretrain_toy_numbers.py runs this parser
def test_the_pretraining_scripts_name_each_bad_flag(card, argv, said, capsys):
    last = refused(lambda: script("pretrain_toy_digits").parse_args(card, argv), capsys)
    assert f": error: {said}" in last, last


def test_pretrain_itself_refuses_before_any_step_and_the_shipped_defaults_pass(tmp_path):
    for card, defaults in CARD_DEFAULTS.items():
        assert defaults.problems() == [], card
    out = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=r"pretraining toy-digits: steps=0: must be a whole number >= 1; "
                                         r"batch_size=-4: must be"):
        pretrain("toy-digits", replace(CARD_DEFAULTS["toy-digits"], steps=0, batch_size=-4, out=str(out)))
    assert not out.exists()
