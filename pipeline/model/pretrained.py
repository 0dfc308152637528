"""`from_pretrained` for a causal-LM folder in any weight format. A folder of torch pickles (`pytorch_model.bin`,
or its shards) is read through the checkpoint loader (pipeline/checkpoints/safe_pickle.py: data only, never code)
and handed to transformers as a state dict, so that transformers never unpickles a file itself; a safetensors
folder goes to transformers as it is."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import model_files


def causal_lm(folder: Path, **kwargs):
    """AutoModelForCausalLM.from_pretrained(folder, **kwargs), its pickled weights read by our loader."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    state = model_files.pickled_state_dict(folder)
    if state is None:
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    config = AutoConfig.from_pretrained(folder)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(None, config=config, state_dict=state, **kwargs)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model
