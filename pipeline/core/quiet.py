"""What a user can do nothing about stays off the terminal: the stack's deprecation chatter (FutureWarning,
DeprecationWarning and friends raised inside torch, transformers, PEFT, DeepSpeed, accelerate, datasets, MLflow),
transformers' weight-loading progress bars and DeepSpeed's INFO lines. Called by the entry points (the stages and
`python -m pipeline`), never on import, so a developer's own code still sees every warning."""

from __future__ import annotations

import logging
import os
import warnings

THIRD_PARTIES = r"(torch|transformers|peft|deepspeed|accelerate|datasets|mlflow|pydantic|hydra|omegaconf|dvc)(\.|$)"
ENVIRONMENT = {  # for this process's libraries and the processes it starts (PYTHONWARNINGS: the latter only)
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}


def quiet_third_parties() -> None:
    """Silence the libraries' warnings and progress bars in this process and the processes it starts."""
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTIES)
    for variable, value in ENVIRONMENT.items():
        os.environ.setdefault(variable, value)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
