"""Where a run's figures go:

- `mlflow_run`: an MLflow run opened or joined, logged to, completed; unreachable servers tolerated.
- `execution`: which pipeline execution a process belongs to, and that execution's one run (every stage and rank 0).
- `runs_view`: what the MLflow UI shows first: model development, runs named after their experiment, a headline view.
- `tensorboard`: the training curve as TensorBoard events.
- `plots`: DVC plot definitions of the curves and evaluation figures.
- `completion`: the run completed from the pipeline's files (stage hashes, missing figures, datasets, artifacts).
"""
