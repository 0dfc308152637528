"""Code shared by tests: tiny LoRA models, the train stage run as a process, workers started by name by deepspeed."""
