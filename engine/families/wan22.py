"""The `wan2.2-t2v` card: Wan2.2 text-to-video A14B, two experts switching at the pipeline's boundary.

A Wan2.2 A14B folder holds two WanTransformer3DModel experts: `transformer`
denoises the high-noise steps and `transformer_2` the low-noise ones.
`WanPipeline` switches at boundary_timestep = boundary_ratio x
num_train_timesteps (T2V-A14B: 0.875 x 1000): a step whose timestep is >= the
boundary runs `transformer`, every later step `transformer_2`. Everything
else is Wan2.1's (the UMT5 prompts, the 16-channel causal video VAE, the
UniPC scheduler for ODE requests), so the card is `WanModel` with one module
in place of the transformer:

- `WanExperts` holds both experts as `high` and `low` and routes each row of
  a forward by its timestep against the boundary. Rollouts, ODE requests and
  the trainers' forwards all call it, so a row at time t meets the same
  expert everywhere (rows of a training batch at different times are split
  between the experts: the routing reads the timesteps back, one host read
  per forward, as the pipeline's own `t >= boundary_timestep` does).
- A LoRA (or full fine-tuning) covers the experts the config trains:
  `model.experts` = both (the default), high or low. Weight sync and
  checkpoints carry the module's trained tensors (`high.*`, `low.*` names),
  so both experts travel when both train. Under DDP the expert a forward did not run
  gets an explicit zero gradient (DDP waits for every trained parameter's).
- The pipeline's `guidance_scale_2` (the low-noise expert's own CFG scale)
  defaults to `guidance_scale`; the engine uses one scale for both experts,
  that default.

Which experts train by default, and why both: each denoising step runs
exactly one expert, so a LoRA on both costs no extra forward work (two small
adapters instead of one) and every stochastic step of a rollout has a
trained policy behind it. Training the low-noise expert alone would leave
the high-noise steps, whose noise sets the layout and motion that
differentiate a GRPO group the most, without gradient (their log-prob ratio
is exactly 1); with T2V-A14B's shift of 12 more than half of the steps are
above the boundary. `model.experts=low` (detail, texture) or `high`
(composition) train one expert; set sampling.sde_window to that expert's
steps then, since SDE steps on a frozen expert add noise but no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cards import ModelCard, register_card
from engine.families.common import check_diffusers_folder, load_pipeline, read_json
from engine.families.wan import WanModel

CARD_ID = "wan2.2-t2v"
PIPELINE = "WanPipeline"
COMPONENTS = {"transformer": "model", "transformer_2": "model", "vae": "model", "scheduler": "scheduler",
              "text_encoder": "model", "tokenizer": "tokenizer"}
EXPERTS = ("high", "low")
# The expert -> the pipeline's component and the LoRA file `save_lora_weights` writes for it (the high-noise
# expert's is diffusers' default name, so `load_lora_weights(folder)` loads it).
DIFFUSERS_EXPERTS = {"high": ("transformer", "pytorch_lora_weights.safetensors"),
                     "low": ("transformer_2", "transformer_2_lora_weights.safetensors")}
LORA_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]


class WanExperts(nn.Module):
    """Wan2.2's two experts as one module: rows at timestep >= boundary go to `high`, the others to `low`."""

    diffusers_experts = DIFFUSERS_EXPERTS

    def __init__(self, high: nn.Module, low: nn.Module, boundary_timestep: float):
        super().__init__()
        self.high, self.low = high, low
        self.boundary_timestep = float(boundary_timestep)

    @property
    def config(self):
        """The experts' shared architecture config (patch size, channels): the high-noise expert's."""
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype

    def enable_gradient_checkpointing(self) -> None:
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    def expert_of(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B] bool: True where a row's timestep (the pipeline's, t x 1000) is the high-noise expert's."""
        return timestep >= self.boundary_timestep

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False, **kwargs):
        out, used = self._routed(hidden_states, timestep, encoder_hidden_states, **kwargs)
        if torch.is_grad_enabled():
            # Trained weights this forward did not use get an explicit zero gradient when no trained weight
            # was used at all (every row on a frozen expert: the loss would have nothing to backpropagate)
            # and under DDP, which waits for a gradient of every trained parameter on every rank.
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            if not out.requires_grad or distributed:
                idle = [p for name in EXPERTS if name not in used
                        for p in getattr(self, name).parameters() if p.requires_grad]
                if idle:
                    out = out + 0.0 * sum(p.reshape(-1)[0] for p in idle)
        return (out,)

    def _routed(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                **kwargs) -> tuple[torch.Tensor, tuple[str, ...]]:
        """The output of every row from its expert, and the experts that ran."""
        high = self.expert_of(timestep)
        n_high = int(high.sum())  # the host read that picks the experts
        args = dict(return_dict=False, **kwargs)
        if n_high == high.numel():
            return self.high(hidden_states=hidden_states, timestep=timestep,
                             encoder_hidden_states=encoder_hidden_states, **args)[0], ("high",)
        if n_high == 0:
            return self.low(hidden_states=hidden_states, timestep=timestep,
                            encoder_hidden_states=encoder_hidden_states, **args)[0], ("low",)
        rows_high, rows_low = high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)
        out_high = self.high(hidden_states=hidden_states[rows_high], timestep=timestep[rows_high],
                             encoder_hidden_states=encoder_hidden_states[rows_high], **args)[0]
        out_low = self.low(hidden_states=hidden_states[rows_low], timestep=timestep[rows_low],
                           encoder_hidden_states=encoder_hidden_states[rows_low], **args)[0]
        out = out_high.new_empty((hidden_states.shape[0], *out_high.shape[1:]))
        out[rows_high], out[rows_low] = out_high, out_low
        return out, EXPERTS


class Wan22Model(WanModel):
    """FlowModel of Wan2.2 T2V A14B: WanModel with `transformer` = WanExperts(high, low)."""

    card_id = CARD_ID

    def __init__(self, pipe, dtype: torch.dtype, scheduler_config: dict):
        super().__init__(pipe, dtype, scheduler_config)
        ratio = pipe.config.boundary_ratio
        if pipe.transformer is None or pipe.transformer_2 is None or ratio is None:
            raise ValueError(f"{CARD_ID}: the folder is not a two-expert Wan2.2 A14B folder (it needs transformer/, "
                             f"transformer_2/ and boundary_ratio in model_index.json; got boundary_ratio={ratio}); "
                             f"a Wan2.1 folder is the wan2.1-t2v card")
        if pipe.config.expand_timesteps:
            raise ValueError(f"{CARD_ID}: expand_timesteps=true (Wan2.2 TI2V-5B) gives each token its own timestep; "
                             f"the card runs the A14B experts only")
        self.boundary_ratio = float(ratio)
        self.transformer = WanExperts(pipe.transformer, pipe.transformer_2,
                                      ratio * pipe.scheduler.config.num_train_timesteps)


def load_wan22(path, device: torch.device, dtype: torch.dtype) -> Wan22Model:
    """Load Wan2.2 T2V A14B from a local diffusers folder (every component in `dtype`)."""
    root = check_diffusers_folder(path, CARD_ID, COMPONENTS)
    pipe = load_pipeline(PIPELINE, root, torch.device(device), dtype)
    return Wan22Model(pipe, dtype, read_json(root / "scheduler" / "scheduler_config.json"))


register_card(ModelCard(
    id=CARD_ID,
    description="Wan2.2 text-to-video A14B (two WanTransformer3DModel experts switching at the pipeline's "
                "boundary_ratio, UMT5, causal video VAE) from a local diffusers folder; model.experts chooses "
                "the trained experts (default both).",
    load=load_wan22,
    # Wan2.2 T2V-A14B: 480p x 81 frames in its release; 33 frames here as the wan2.1 card.
    defaults=dict(steps=10, guidance_scale=4.0, noise_level=0.7, height=480, width=832, frames=33,
                  lora_targets=LORA_TARGETS, diffusers_pipeline=PIPELINE, video=True, experts="both"),
))
