"""Training on DeepSpeed ranks, read top to bottom in the order a run goes (`pipeline.launching` starts the ranks):

- `recipe`: the train stage's one call: the launch resolved, the ranks started, the run planned and checked, the
  ranks released and waited for; a finished run's figures reported instead.
- `plan`: the run resolved once by the stage (paths, launch, model, schedule, run state, resume point) into frozen
  dataclasses, written as `plan.json`: the only thing a rank reads.
- `memory_estimate`: the memory a rank will need (parameters, gradients, optimizer, activations), checked against
  the node before anything launches.
- `initial`: a run started from an existing adapter (`train.init_adapter`), checked and placed into the engine.
- `resume`: the one decision that a run is finished; the checkpoint folder made ready (another configuration's
  moved aside, another layout converted to the universal one); the ranks' load of what they continue from.
- `rank`: one rank (`python -m pipeline.training.rank --plan P`): the engine with the kernels the plan's switch
  chooses, reporting (rank 0: MLflow, TensorBoard, progress), the loop, the final figures.
- `loop`: resume point to last step, in named steps: DPO's reference, train step (accumulate), validation, report,
  checkpoint.
- `preference`: the preference objectives (DPO, SimPO, ORPO): pair batches, losses, rewards, DPO's reference.
- `sequence_parallel`: the sequence- and data-parallel groups of a rank (`train.sequence_parallel`), the model
  checked; `ulysses`: the model of such a rank (its shard of every micro-batch, DeepSpeed's Ulysses attention).
- `schedule`: the data order and learning rate as pure functions of the step; `ds_config`: the DeepSpeed config
  (precision, accumulation, ZeRO), typed, built from the launch settings; `figures`: per-rank values, peak memory,
  MFU, the summary and the curve; `profile`: an opt-in torch profiler over a few steps.
- `zero_writer`: a universal checkpoint -> the ZeRO layout of N ranks (ranks build an engine and save it).
"""
