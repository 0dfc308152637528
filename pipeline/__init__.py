"""The library behind the stages: packages by concern, each importing only those before it in this list (checked by
`python -m tools.layers`): core, data, tracking, checkpoints, model, kernels, launching, training, merge, evaluation,
export. Above them all:

- `check`: the whole configuration and every input file it names, checked before any stage runs (the check stage).
- `cli`: `python -m pipeline COMMAND` (`__main__`): consolidate, convert, merge, evaluate, chat, generate, export.
"""
