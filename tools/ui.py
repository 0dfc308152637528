"""`make ui`: the MLflow UI over the project's store, after printing where the runs are: the experiment's runs table
in the headline view (pipeline/tracking/runs_view.py), in the UI's model-training mode.

    python -m tools.ui --store sqlite:///mlruns.db --port 5000 [--experiment llm-lora]
"""

from __future__ import annotations

import argparse
import os
import shutil

from pipeline.tracking.runs_view import runs_url


def experiment_id(store: str, name: str) -> str | None:
    """The experiment's id in `store` (None where it is not there yet, or the store cannot be read)."""
    from mlflow import MlflowClient

    try:
        found = MlflowClient(store).get_experiment_by_name(name)
    except Exception:  # a store that does not exist yet: the server creates it
        return None
    return found.experiment_id if found else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="sqlite:///mlruns.db", help="MLflow backend store URI")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--experiment", default="llm-lora", help="whose runs to open (tracking.experiment)")
    args = parser.parse_args(argv)
    base = f"http://127.0.0.1:{args.port}"
    found = experiment_id(args.store, args.experiment)
    where = runs_url(base, found) if found else f"{base}/#/?workflowType=machine_learning"
    print(f"ui: the runs of {args.experiment}: {where}", flush=True)
    server = shutil.which("mlflow") or "mlflow"
    command = [server, "server", "--backend-store-uri", args.store, "--host", "127.0.0.1", "--port", str(args.port)]
    os.execv(server, [*command, "--workers", "1"])


if __name__ == "__main__":
    main()
