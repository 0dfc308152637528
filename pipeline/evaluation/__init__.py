"""What a model is worth:

- `likelihood`: bits per byte and perplexity on held-out sets (comparable across tokenizers); loading a model,
  base + adapter or merged, for inference.
- `tasks`: task accuracy through lm-evaluation-harness.
- `preference`: accuracy and margins on held-out preference pairs (`eval.preference_sets`).
- `comparison`: the base, base + adapter and merged models side by side (sets, samples, tasks) and their tables.
- `results`: eval.json's layout (figures per set and model; task scores, preference figures, variant beside them).
- `report`: the results as terminal tables, and the MLflow run's description.
- `chat`: talking to a model (interactive, or one generation for scripts).
"""
