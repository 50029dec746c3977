"""The building blocks every recipe shares (trainers/<algo>.py keeps its config section, loss and algorithm class).

- `sections`: the shared config sections and their checks, as the recipes import them (they live in
  flywheel/config/), and the engine requests of a rollout and an evaluation;
- `policy`: the model, its trainable weights (full or LoRA), the reference policy and the optimizer;
- `algorithm`: the protocol a recipe implements (`update`, `serving_weights`, `state_dict`);
- `training_loop`: the loop, eight numbered phases per step, which owns the weight version;
- `session`: the run (accelerator, run directory, trackers, resume, evaluation with judges,
  checkpoints, metrics, progress, the finish lines) that the loop drives;
- `rollouts` and `layouts`: the engine in its layout (colocated, a served copy, an engine process, a Ray pool,
  a workflow stage), weight sync, rewards and the rollout collector;
- `update`: the gradient side of an update (minibatches, accumulation, clipping, guarded optimizer steps).
"""
