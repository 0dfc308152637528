"""Where a run's figures go:

- `mlflow_run`: the pipeline execution's one MLflow run (opened, joined by every stage and rank 0, completed).
- `tensorboard`: the training curve as TensorBoard events.
- `plots`: DVC plot definitions of the curves and evaluation figures.
- `completion`: the run completed from the pipeline's files (stage hashes, missing figures, datasets, artifacts).
"""
