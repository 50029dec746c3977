"""Run a recipe under FSDP on CPU processes: `accelerate launch --config_file <fsdp config, use_cpu: true>
tests/cpu_fsdp.py trainers/<recipe>.py key=value ...`.

accelerate applies FSDP on accelerators only (on CPUs it falls back to data parallelism and the recipe says so),
and CI has none, so the recipes' FSDP path (parameters as flat shards, gathered for rollouts and checkpoints;
the optimizer's state in shards) would go untested. torch's FSDP (version 1) itself runs on CPU processes over
gloo: this wrapper makes accelerate choose it there, as it would on GPUs, then runs the recipe."""

import runpy
import sys

import torch
from accelerate import state as accelerate_state
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FullyShardedDataParallel

_state_init = accelerate_state.AcceleratorState.__init__


def _fsdp_on_cpu(self, *args, **kwargs):
    _state_init(self, *args, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and getattr(self, "fsdp_plugin", None) is None:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* environment
        # AcceleratorState copies PartialState's shared fields back in on every construction.
        accelerate_state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


_fsdp_init = FullyShardedDataParallel.__init__


def _on_the_cpu(self, module, *args, device_id=None, **kwargs):
    # accelerate passes its device ("cpu:<rank>" on CPU processes), which FSDP finds inconsistent with the
    # parameters' plain "cpu".
    _fsdp_init(self, module, *args, device_id=torch.device("cpu"), **kwargs)


accelerate_state.AcceleratorState.__init__ = _fsdp_on_cpu
FullyShardedDataParallel.__init__ = _on_the_cpu
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
