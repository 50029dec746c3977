"""Test environment: offline, deterministic, small."""

import os

# An accidental hub call otherwise hangs for ~48 s before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Idle OpenMP threads sleep instead of spinning (flywheel/openmp_env.py, which the recipes import before torch):
# the suite starts recipe and engine processes beside this one, and a spinning thread takes their cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist each worker shares the cores with the others: one thread each (and for the recipe and
# engine processes a test starts) keeps them from taking each other's time slices.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def toy_model():
    """The shipped toy-digits model (loaded once; tests must not train it in place)."""
    from engine import load_model

    return load_model("toy-digits")


@pytest.fixture
def toy_engine(toy_model):
    from engine import Engine

    return Engine(toy_model)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker per core, at most 4. Several tests start recipe runs of two
    processes and engine or Ray processes of their own, so more workers than cores only queue for them
    (PYTEST_XDIST_AUTO_NUM_WORKERS overrides)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


# The files that take longest (pytest --durations, 2026-12-02), started first: the workers get whole files in
# collection order (--dist loadfile), so a long file collected last would leave the other workers idle at the end.
LONGEST_FILES = ("test_grpo_variants.py", "test_toy_numbers.py", "test_workflows_rl.py", "test_grpo.py",
                 "test_config_metrics.py", "test_resume_recipes.py", "test_dppo.py", "test_rundir_lock.py",
                 "test_recipe_guards.py", "test_ray_grpo.py", "test_awm.py", "test_vlm_judge.py", "test_families_edit.py",
                 "test_families_2026.py", "test_nft.py", "test_dpo.py", "test_draft.py", "test_ray_pool.py",
                 "test_distributed_configs.py", "test_faults_async.py", "test_families.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
    # A test that lowers torch's threads must not change the next one's numbers (recipes keep a lowered count).
    torch.set_num_threads(_THREADS)
