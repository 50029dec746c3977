"""Every recipe command the README and docs/ show still starts: its `--config` files and keys resolve and pass the
checks a run makes before any work (`resolve_config` + the recipe's `validate_config`), so a renamed key or a
moved config file breaks this test instead of a new user's first command."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# `python trainers/<recipe>.py ...` or `accelerate launch [--flag [value]]... trainers/<recipe>.py ...`, up to the
# end of the inline code, the line, a table cell or a shell comment.
COMMAND = re.compile(r"(?:accelerate launch(?: --[\w-]+(?: [\w.]+)?)* |python )trainers/(\w+)\.py([^`\n|#]*)")
WRAPPED_INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)\n([^`\n]+)`(?!`)")
# Commands that show a shape, not a runnable line: placeholders, and what needs the user's own files or a
# server running beside the run.
NOT_RUNNABLE = ("...", "<", "--help", "resume=", "my_prompts.jsonl", "remote:http")


def documented_commands() -> list[tuple[str, str, str]]:
    """(page, recipe, arguments) of each distinct runnable recipe command in the docs."""
    found = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8").replace("\\\n", " ")  # a shell line continued
        text = WRAPPED_INLINE_CODE.sub(lambda m: f"`{m[1]} {m[2]}`", text)  # inline code a paragraph wrapped
        for match in COMMAND.finditer(text):
            recipe, args = match.group(1), " ".join(match.group(2).split())
            if any(marker in args for marker in NOT_RUNNABLE) or args.endswith("--config"):
                continue
            found.setdefault((recipe, args), str(page.relative_to(ROOT)))
    return [(page, recipe, args) for (recipe, args), page in found.items()]


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_recipe():
    # The extraction itself works: the README's main job, and each recipe's own commands, are among them.
    assert ("grpo", "") in {(r, a) for _, r, a in COMMANDS}
    assert {r for _, r, _ in COMMANDS} == {"grpo", "nft", "awm", "dpo", "draft"}
    assert {("nft", "--config configs/toy_numbers_nft.yaml"), ("draft", "train.mode=refl")} <= {(r, a) for _, r, a in
                                                                                               COMMANDS}
    assert len(COMMANDS) >= 30


@pytest.mark.parametrize("page,recipe,args", COMMANDS, ids=[f"{r} {a}"[:80] for _, r, a in COMMANDS])
def test_a_documented_command_resolves_and_passes_the_checks_before_work(page, recipe, args, tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths (configs/...) are the repository's
    monkeypatch.syspath_prepend(str(ROOT / "trainers"))
    module = importlib.import_module(recipe)
    argv = shlex.split(args) + [f"run_dir={tmp_path / 'run'}"]  # a fresh run dir: the docs' own may be in use here
    cfg = module.resolve_config(module.Config, argv, recipe=recipe)
    module.validate_config(cfg)
    assert not (tmp_path / "run").exists()  # the checks wrote nothing
    for key in (a.split("=", 1)[0] for a in argv if "=" in a and not a.startswith("-")):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)  # the key reached the config under its documented name
