"""What the diffusers families share: folder checks, the scheduler's flow times, dtype policy.

Two schedules come from a folder's scheduler. Rollouts (Flow-SDE / CPS, and
the deterministic steps around an SDE window) step the project's own samplers
on `scheduler_flow_times`: the flow times a FlowMatchEulerDiscreteScheduler
with the folder's shift would use. ODE requests (evaluation, serving) on a
folder whose scheduler is anything else (Wan's default UniPC, DPM-Solver, ...)
are stepped by a fresh instance of that scheduler (`folder_ode_scheduler`), so
their final latents equal the stock pipeline's for any scheduler.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "spiece.model")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own bound on a header's length


def check_diffusers_folder(path: str | Path | None, card_id: str, components: dict[str, str]) -> Path:
    """Fail with one message listing everything missing from a local diffusers folder.

    components maps a subfolder to its kind: "model" (config.json + weights),
    "tokenizer" (tokenizer files), "scheduler" (scheduler_config.json) or
    "processor" (a processor's preprocessor_config.json, or processor_config.json as transformers 5 writes
    a multimodal one).
    """
    if path is None:
        raise ValueError(f"model card {card_id!r} needs model.path: a local diffusers folder "
                         f"(with model_index.json and {', '.join(components)}); nothing is downloaded")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{card_id}: model.path={str(root)!r} is not a folder; expected a local diffusers "
                                f"folder with model_index.json and {', '.join(components)}")
    problems = diffusers_folder_problems(root, components)
    if problems:
        raise FileNotFoundError(f"{card_id}: the diffusers folder {root} is incomplete; {'; '.join(problems)}")
    return root


def diffusers_folder_problems(root: Path, components: dict[str, str]) -> list[str]:
    """What `check_diffusers_folder` finds wrong with the folder `root`: "missing: a; b" and "unreadable: c (why)"
    entries, each present only when it lists something; [] for a complete folder."""
    missing, unreadable = [], []
    if not (root / "model_index.json").is_file():
        missing.append("model_index.json")
    for sub, kind in components.items():
        folder = root / sub
        if not folder.is_dir():
            missing.append(f"{sub}/ ({kind})")
            continue
        if kind == "model":
            if not (folder / "config.json").is_file():
                missing.append(f"{sub}/config.json")
            if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in folder.iterdir()):
                missing.append(f"{sub}/*.safetensors (weights)")
            for index in sorted(folder.glob("*.safetensors.index.json")):  # sharded weights: every shard it maps
                try:
                    shards = set(read_json(index).get("weight_map", {}).values())
                except (OSError, ValueError, AttributeError) as e:
                    unreadable.append(f"{sub}/{index.name} ({e})")
                    continue
                missing.extend(f"{sub}/{shard} (listed in {index.name})" for shard in sorted(shards)
                               if not (folder / str(shard)).is_file())
            weights = sorted(folder.glob("*.safetensors"))
            unreadable.extend(f"{sub}/{entry}" for entry in unreadable_safetensors(weights))
        elif kind == "tokenizer":
            if not any((folder / f).is_file() for f in TOKENIZER_FILES):
                missing.append(f"{sub}/ tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
        elif kind == "scheduler":
            if not (folder / "scheduler_config.json").is_file():
                missing.append(f"{sub}/scheduler_config.json")
        elif kind == "processor":
            if not any((folder / f).is_file() for f in PROCESSOR_FILES):
                missing.append(f"{sub}/preprocessor_config.json")
    return ([f"missing: {'; '.join(missing)}"] if missing else []) + (
        [f"unreadable: {'; '.join(unreadable)}"] if unreadable else [])


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be read whole, from its header and size alone (a few KB read), or None.

    The format is an 8-byte little-endian header length, a JSON header whose tensors give their byte ranges, then
    the data; safetensors refuses a file whose size is not exactly that. Caught here: a download stopped
    half-way (shorter), a Git LFS pointer (a text file, not a header), a file that is not safetensors at all.
    """
    try:
        size = path.stat().st_size  # a dangling link (a cache folder moved away) fails here
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if head.startswith(b"version "):
                return "not a safetensors file: a Git LFS pointer; run `git lfs pull`"
            if length < 2 or length > MAX_SAFETENSORS_HEADER:
                return f"not a safetensors file: {size} bytes, no header"
            if 8 + length > size:
                return f"{size} bytes, cut short inside its {length}-byte header; download it again"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        return f"its header does not read: {e}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"
            and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list) and entry["data_offsets"]]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"{size} bytes where its header says {expected}: " + ("cut short; download it again"
                                                                   if size < expected else "bytes after its data")
    return None


def unreadable_safetensors(files) -> list[str]:
    """"name (why)" for each of `files` (.safetensors paths) that `safetensors_problem` finds unreadable."""
    return [f"{Path(f).name} ({why})" for f in files if (why := safetensors_problem(Path(f))) is not None]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def scheduler_flow_times(scheduler_config: dict, steps: int, image_seq_len: int | None = None,
                         flux_sigmas: bool = False) -> torch.Tensor:
    """The flow times [T+1] (1 -> 0, fp32) diffusers' FlowMatchEulerDiscreteScheduler would use.

    The scheduler itself computes them, so shifts (static or resolution-dependent)
    match the stock pipeline exactly. `flux_sigmas`: FLUX passes linspace(1, 1/T)
    instead of the scheduler's default; dynamic shifting needs `image_seq_len`.
    """
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    if "flow_shift" in config and "shift" not in config:  # UniPC-style configs (Wan) name the shift flow_shift
        config["shift"] = config["flow_shift"]
    # Only the Euler scheduler's own settings: another class's extras (UniPC's solver_order, ...) have no
    # meaning here, and passing them makes diffusers warn on every call.
    accepted = inspect.signature(FlowMatchEulerDiscreteScheduler.__init__).parameters
    scheduler = FlowMatchEulerDiscreteScheduler.from_config({k: v for k, v in config.items() if k in accepted})
    kwargs = {}
    if scheduler.config.use_dynamic_shifting:
        if image_seq_len is None:
            raise ValueError("this scheduler shifts by resolution: image_seq_len is required")
        kwargs["mu"] = flux_shift_mu(image_seq_len, scheduler.config)
    if flux_sigmas:
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), **kwargs)
    else:
        scheduler.set_timesteps(steps, **kwargs)
    return scheduler.sigmas.to(torch.float32)


def flux_shift_mu(image_seq_len: int, config, default_max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift: linear in the token count between two anchors.

    Anchors missing from `config` take the pipelines' defaults; they differ only in
    `max_shift` (FluxPipeline 1.15, StableDiffusion3Pipeline 1.16).
    """
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", default_max_shift)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + base_shift - slope * base_len


def is_euler_scheduler(scheduler) -> bool:
    """Whether a folder's scheduler is FlowMatchEulerDiscreteScheduler (the engine's Euler steps equal its ODE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return isinstance(scheduler, FlowMatchEulerDiscreteScheduler)


def folder_ode_scheduler(folder_scheduler, steps: int, device: torch.device, sigmas=None, mu: float | None = None):
    """A fresh instance of a folder's scheduler, set for `steps` as the stock pipeline sets it; None for Euler.

    `sigmas` / `mu` are what the family's pipeline passes to `set_timesteps`
    (FLUX: its own sigma grid and resolution shift). A multistep solver keeps
    the previous steps' model outputs on the instance, so each batch gets its
    own. Raises ValueError, before any work, if the scheduler cannot be set
    the way the pipeline sets it or does not give one flow time per state.
    """
    if is_euler_scheduler(folder_scheduler):
        return None
    cls = type(folder_scheduler)
    scheduler = cls.from_config(folder_scheduler.config)
    accepted = inspect.signature(scheduler.set_timesteps).parameters
    kwargs = {"device": device}
    if mu is not None:
        kwargs["mu"] = mu
    if sigmas is not None:
        kwargs["sigmas"] = sigmas
    unsupported = [k for k in kwargs if k not in accepted]
    if unsupported:
        raise ValueError(f"the folder's scheduler {cls.__name__} cannot be set up as its pipeline does: its "
                         f"set_timesteps takes no {', '.join(unsupported)} (it takes: "
                         f"{', '.join(p for p in accepted if p != 'self')}); use a flow-matching scheduler that "
                         f"does, e.g. FlowMatchEulerDiscreteScheduler or UniPCMultistepScheduler(use_flow_sigmas=True)")
    if sigmas is None:
        scheduler.set_timesteps(steps, **kwargs)
    else:
        scheduler.set_timesteps(**kwargs)
    if len(scheduler.sigmas) != len(scheduler.timesteps) + 1:
        raise ValueError(f"the folder's scheduler {cls.__name__} gives {len(scheduler.timesteps)} timesteps but "
                         f"{len(scheduler.sigmas)} sigmas; the engine needs one flow time per state (timesteps + 1)")
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)  # as the pipelines do: no host lookup of the first step's index
    return scheduler


def flow_time_to_batch(t: torch.Tensor | float, batch: int, device: torch.device) -> torch.Tensor:
    """A scalar or [B] flow time as a [B] fp32 tensor on `device` (no host transfer)."""
    return torch.as_tensor(t, dtype=torch.float32, device=device).reshape(-1).expand(batch)


def load_family(model_class, pipeline_class: str, components: dict[str, str], path, device, dtype: torch.dtype):
    """A family's FlowModel from a local folder: the folder checked (every missing component in one error),
    its stock pipeline loaded in `dtype` on `device`, and `model_class(pipe, dtype, scheduler config)`."""
    root = check_diffusers_folder(path, model_class.card_id, components)
    pipe = load_pipeline(pipeline_class, root, torch.device(device), dtype)
    return model_class(pipe, dtype, read_json(root / "scheduler" / "scheduler_config.json"))


def load_pipeline(pipeline_class: str, root: Path, device: torch.device, dtype: torch.dtype):
    """The stock diffusers pipeline of a local folder, every component in `dtype` on `device`, eval mode."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    return prepare_pipeline(cls.from_pretrained(str(root), dtype=dtype, local_files_only=True), device)


def prepare_pipeline(pipe, device: torch.device, dtype: torch.dtype | None = None):
    """Every module of a pipeline on `device` (and cast to `dtype` if given), frozen, eval mode, no progress bars."""
    if dtype is None:
        pipe.to(device)
    else:
        pipe.to(device=device, dtype=dtype)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sequence_length(tokenizer, family_default: int) -> int:
    """Text tokens per prompt: the family's default, capped by what the tokenizer declares it handles."""
    declared = getattr(tokenizer, "model_max_length", None)
    return family_default if not declared or declared > 100_000 else min(family_default, declared)


def decode_image_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """An image VAE's latents (with diffusers' scaling and shift factors) to images [B, 3, H, W] in [0, 1], fp32."""
    config = vae.config
    latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
    images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0.0, 1.0)


def image_latent_shape(card_id: str, height: int | None, width: int | None, frames: int | None,
                       default_size: int, vae_scale: int, multiple: int, channels: int) -> tuple[int, ...]:
    """(C, H/s, W/s) of an image card; H and W default to its native size and must be multiples of `multiple`."""
    if frames not in (None, 1):
        raise ValueError(f"{card_id} generates images, not videos; got frames={frames} (use frames=None)")
    height, width = height or default_size, width or default_size
    if height % multiple or width % multiple:
        raise ValueError(f"{card_id}: height and width must be multiples of {multiple}; got {height}x{width}")
    return (channels, height // vae_scale, width // vae_scale)


class DiffusersFlowModel:
    """What every family's FlowModel holds: the stock pipeline, its transformer and VAE, the weight
    dtype, the scheduler's config and the text tokens per prompt."""

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict, tokenizer, max_sequence_length: int):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.dtype = dtype
        self.scheduler_config = scheduler_config
        # Text tokens per prompt (SD3: 256, FLUX and Wan: 512, as their pipelines use), capped by the tokenizer.
        self.max_sequence_length = sequence_length(tokenizer, max_sequence_length)

    @property
    def device(self) -> torch.device:
        return self.vae.device

    def ode_scheduler(self, steps: int, latent_shape: tuple[int, ...]):
        """The folder's own scheduler, set for an ODE request of `steps` (None when it is plain Euler).

        Families whose pipeline passes sigmas or a shift to `set_timesteps` override this.
        """
        return folder_ode_scheduler(self.pipe.scheduler, steps, self.device)
