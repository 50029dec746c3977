"""The "What to install" table of docs/models.md against pyproject.toml's extras and what each module imports.

Every model card (but the toy ones) and every built-in reward has one row; the
extras a row names exist; and the third-party packages the card's or reward's
modules import (read from their source, so lazy imports count) are core
dependencies or come with that row's extras.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = {"engine", "rewards", "flywheel", "trainers"}
# Distribution name (pyproject) -> the name it is imported as, where they differ.
IMPORT_NAMES = {"scikit-learn": "sklearn", "pillow": "PIL", "pyyaml": "yaml", "imageio-ffmpeg": "imageio_ffmpeg"}
# The source files behind each card and reward of the table (what its loader or scorer runs).
FAMILY = ["engine/families/common.py", "flywheel/video.py"]
SOURCES = {
    "sd3": ["engine/families/sd3.py", *FAMILY], "flux": ["engine/families/flux.py", *FAMILY],
    "qwen-image": ["engine/families/qwen_image.py", *FAMILY], "wan2.1-t2v": ["engine/families/wan.py", *FAMILY],
    "wan2.1-i2v": ["engine/families/wan_i2v.py", *FAMILY], "ltx2": ["engine/families/ltx2.py", *FAMILY],
    "flux2-klein": ["engine/families/flux2_klein.py", *FAMILY], "z-image": ["engine/families/z_image.py", *FAMILY],
    "wan2.2-t2v": ["engine/families/wan22.py", "engine/families/wan.py", *FAMILY],
    "flux-kontext": ["engine/families/flux_kontext.py", *FAMILY],
    "qwen-image-edit-plus": ["engine/families/qwen_image_edit.py", *FAMILY],
    "edit_consistency": ["rewards/edit.py", "rewards/clip.py"], "edit_instruction_clip": ["rewards/edit.py", "rewards/clip.py"],
    "clip_score": ["rewards/clip.py"], "pickscore": ["rewards/clip.py"], "aesthetic": ["rewards/clip.py"],
    "ocr": ["rewards/ocr.py"], "digit_alignment": ["rewards/digits.py"], "number_alignment": ["rewards/digits.py"],
    "jpeg_compressibility": ["rewards/jpeg.py"], "jpeg_incompressibility": ["rewards/jpeg.py"],
    "audio_loudness": ["rewards/audio.py"], "av_onset_sync": ["rewards/audio.py"],
    "clip_score_video": ["rewards/video.py", "rewards/clip.py"], "pickscore_video": ["rewards/video.py", "rewards/clip.py"],
    "aesthetic_video": ["rewards/video.py", "rewards/clip.py"], "hpsv3": ["rewards/hpsv3.py"],
    "vlm_judge": ["rewards/vlm_judge.py"],
}
TOY_CARDS = {"toy-digits", "toy-numbers"}


def install_table() -> dict[str, set[str]]:
    """Table row name -> the extras its install cell names (empty for "nothing more")."""
    text = (ROOT / "docs" / "models.md").read_text()
    start = text.index("## What to install")
    lines = text[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| for |"))
    rows = {}
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        extras = re.search(r'\.\[([a-z,]+)\]', cells[1])
        for name in re.findall(r"`([^`]+)`", cells[0]):
            assert name not in rows, f"{name} is in two rows"
            rows[name] = set(extras.group(1).split(",")) if extras else set()
    return rows


def distributions(specs: list[str]) -> set[str]:
    """Import names of pyproject requirement specs ("torch==2.13.0" -> torch), extras references dropped."""
    names = {re.split(r"[=<>\[ ]", spec, maxsplit=1)[0].lower() for spec in specs}
    return {IMPORT_NAMES.get(n, n).replace("-", "_") for n in names if n != "flywheel"}


def third_party_imports(path: Path) -> set[str]:
    """Top-level package names a module imports anywhere (function bodies included), stdlib and project left out."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in PROJECT_PACKAGES}


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_card_and_builtin_reward_has_one_row_and_every_extra_exists(pyproject):
    import rewards
    from engine import list_cards

    rows = install_table()
    named = set(rows) - {"rollout.backend=ray", "flywheel.scale", "tracker=tensorboard", "tracker=trackio",
                         "tracker=mlflow"}
    assert named == (set(list_cards()) - TOY_CARDS) | set(rewards.available())
    assert set(SOURCES) == named
    extras = pyproject["optional-dependencies"]
    for name, wanted in rows.items():
        assert wanted <= set(extras), f"{name}: docs/models.md names extras {wanted - set(extras)} that pyproject lacks"
    assert rows["rollout.backend=ray"] == {"ray"} and "ray" in distributions(extras["ray"])


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_what_a_card_or_reward_imports_comes_with_its_row(pyproject, name):
    rows = install_table()
    core = distributions(pyproject["dependencies"])
    given = core | {d for extra in rows[name] for d in distributions(pyproject["optional-dependencies"][extra])}
    imported = set().union(*(third_party_imports(ROOT / f) for f in SOURCES[name]))
    assert imported - given == set(), f"{name} imports {imported - given}, not in its row's extras {rows[name]}"
    if rows[name]:  # and a row that names an extra needs it: nothing more would do
        assert imported - core, f"{name}: its row names {rows[name]} but it imports only core dependencies"
