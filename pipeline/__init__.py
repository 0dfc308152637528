"""The library behind the stages: packages by concern, each importing only those before it in this list (checked by
`python -m tools.layers`): core, data, tracking, checkpoints, model, kernels, launching, training, merge, evaluation,
export; `cli` (`python -m pipeline`) on top."""
