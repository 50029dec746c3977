"""docs/configuration.md lists every key of every shared section with its default and docstring, and every old
key name: its generated part is what `python -m flywheel.config.reference` prints from the dataclasses now."""

from __future__ import annotations

import dataclasses

from flywheel.config.aliases import ALIASES
from flywheel.config.reference import BEGIN, END, PAGE, SECTIONS, page_with_reference, reference
from flywheel.config.sections import RunConfig


def test_the_page_holds_the_reference_generated_from_the_dataclasses():
    page = PAGE.read_text(encoding="utf-8")
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    assert page_with_reference(page) == page, (
        "docs/configuration.md is out of date with the config dataclasses: run "
        "`python -m flywheel.config.reference --write`")


def test_the_reference_has_every_key_its_default_and_every_alias():
    text = reference()
    for prefix, cls, _ in SECTIONS:
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if prefix == "" and key in {s for s, _, _ in SECTIONS}:
                continue  # a section: it has its own table
            assert f"| `{key}` |" in text, key
    assert "| `ema.decay` | `float` | `0.9` | EMA <- decay" in text
    assert "| `rollout.asynchronous` | `bool` | `false` |" in text
    for old, new in ALIASES.items():
        assert f"| `{old}` | `{new}` |" in text
    # Every section of the recipes' base config has a table, and nothing else does.
    sections = {f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(f.default_factory)}
    assert sections <= {s for s, _, _ in SECTIONS}


def test_the_command_answers_help_and_refuses_an_unknown_flag_without_touching_the_page(capsys):
    import pytest

    from flywheel.config.reference import main

    before = PAGE.read_bytes()
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "--write" in capsys.readouterr().out  # usage, not the reference
    with pytest.raises(SystemExit) as done:
        main(["--wrte"])
    assert done.value.code == 2 and "unrecognized arguments: --wrte" in capsys.readouterr().err
    assert main([]) == 0 and capsys.readouterr().out == reference()
    assert PAGE.read_bytes() == before


def test_a_page_without_its_markers_is_named_not_a_substring_error():
    import pytest

    with pytest.raises(ValueError, match="must hold the line .* exactly once \\(it holds it 0 times\\)"):
        page_with_reference("no markers here\n")
    with pytest.raises(ValueError, match="comes before the start marker"):
        page_with_reference(f"{END}\n{BEGIN}\n")
