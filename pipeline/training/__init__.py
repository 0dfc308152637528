"""Training on DeepSpeed ranks, read top to bottom in the order a run goes:

- `plan`: the run resolved once by the stage (paths, launch, model, schedule, resume point) into frozen
  dataclasses, written as `plan.json`: the only thing a rank reads.
- `resume`: the one decision that a run is finished; the checkpoint folder made ready (another configuration's
  moved aside, another layout converted to the universal one); the ranks' load of what they continue from.
- (`pipeline.launching` starts the ranks, on this node or several.)
- `rank`: one rank (`python -m pipeline.training.rank --plan P`): the engine with the kernels the plan's switch
  chooses, reporting (rank 0: MLflow, TensorBoard, progress), the loop, the final figures.
- `loop`: resume point to last step: accumulate, step, validate, checkpoint, report.
- `schedule`: the data order and learning rate as pure functions of the step; `ds_config`: the DeepSpeed config
  (precision, accumulation, ZeRO) generated from the launch settings; `figures`: per-rank values, peak memory, MFU,
  the curve.
- `zero_writer`: a universal checkpoint -> the ZeRO layout of N ranks (ranks build an engine and save it).
"""
