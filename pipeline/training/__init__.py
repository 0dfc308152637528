"""Training on DeepSpeed ranks, read top to bottom in the order a run goes:

- `plan`: the run resolved once by the stage (paths, launch, model, schedule, resume point) into frozen
  dataclasses, written as `plan.json`: the only thing a rank reads.
- `resume`: the one decision that a run is finished; the checkpoint folder made ready (another configuration's
  moved aside, another layout converted to the universal one); the ranks' load of what they continue from.
- `launch`: this node's ranks started early, released once the plan is written (the deepspeed launcher on several
  nodes), ended together; stale op-build locks and shared memory cleared; the ops built once (`make setup`).
- `rank`: one rank (`python -m pipeline.training.rank --plan P`): the engine with the kernels the plan's switch
  chooses, reporting (rank 0: MLflow, TensorBoard, progress), the loop, the final figures.
- `loop`: resume point to last step: accumulate, step, validate, checkpoint, report.
- `sequence_parallel`: `train.sequence_parallel` checked, the sequence- and data-parallel groups of a rank;
  `ulysses`: the model of such a rank (its shard of every micro-batch, DeepSpeed's Ulysses attention).
- `schedule`: the data order and learning rate as pure functions of the step; `ds_config`: the DeepSpeed config
  (precision, accumulation, ZeRO) generated and checked; `figures`: per-rank values, peak memory, MFU, the curve.
- `zero_writer`: a universal checkpoint -> the ZeRO layout of N ranks (ranks build an engine and save it).
"""
