"""What every other package uses; imports nothing of ours outside core:

- `atomic`: outputs written to a temporary path and renamed into place; strict JSON reads.
- `errors`: bad input printed as one line, exit 2, no traceback.
- `log`: the one logger: `name: message` lines on global rank 0 (progress on stdout, warnings on stderr).
- `config`: the schema of params.yaml (the only module that reads it), and the composition of conf/ into it.
- `assets`: files of the packages that ship the default's model and corpora.
- `precision`: dtype names, what the hardware computes natively, inference dtypes.
- `imports`: PEFT and transformers imported without the optional parts a run does not use; torch imported at its
  first use (`imports.torch`) by the modules the train stage plans with.
- `deepspeed_patches`: every patch of DeepSpeed's internals, each written for one DeepSpeed version and left off
  with a warning on another: DeepSpeed's import (`imported`) and the engine paths `kernels.tune_engine` installs.
- `environment`: child processes' PATH and op folder, stale build locks, a free port.
- `quiet`: third-party warnings and progress bars silenced.
"""
