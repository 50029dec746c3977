"""The building blocks every recipe shares (trainers/<algo>.py keeps only its config section, loss and update).

- `sections`: the shared config sections (run, model, data, sampling, optimizer) and their checks;
- `policy`: the model, its trainable weights (full or LoRA), the reference policy and the optimizer;
- `session`: the run (accelerator, run directory, trackers, resume, evaluation with judges,
  checkpoints, metrics, progress) and the loop that drives an algorithm's `update(batch, step)`;
- `rollouts`: the engine (colocated or in its own process), weight sync, rewards and the flywheel;
- `update`: the gradient side of an update (minibatches, accumulation, clipping, guarded optimizer steps).
"""
