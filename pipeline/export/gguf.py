"""Export an HF model folder (LLaMA, Mistral without a sliding window, Qwen2, Qwen3) to one GGUF file (llama.cpp,
Ollama) with its byte-level BPE tokenizer inside, through the `gguf` package: its writer, and its own map of HF
tensor names to GGUF's for each architecture (`gguf.get_tensor_name_map`, llama.cpp's). 2-D weights are stored as
f16 or q8_0 (rows whose length is not a multiple of 32 stay f16), norms and biases as f32; tensors stream from the
safetensors shards one at a time.

GGML's `llama` architecture applies rotary embeddings to interleaved pairs of a head's dimensions, transformers' to
its two halves: for it the rows of q_proj and k_proj are reordered from the second layout to the first (readers undo
it on load); Qwen's architectures rotate halves in GGML too (NeoX style) and are stored as they are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.core.atomic import atomic_path, read_json

TYPES = ("f16", "q8_0")
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # HF -> GGUF (llama.cpp's)
READ_QWEN3_HEAD_DIM = 128  # transformers' GGUF reader maps no key to Qwen3's head_dim: its default
INTERLEAVED_ROTARY = ("llama",)  # GGUF architectures whose q and k rows are stored in GGML's rotary order
Q8_BLOCK, Q8_BLOCK_BYTES = 32, 34  # q8_0: 32 weights as int8 plus one f16 scale


def check_exportable(model_dir: Path, type_name: str) -> dict:
    """config.json of a model this exporter can write, with `pre_tokenizer` (llama.cpp's name for its tokenizer's
    split) added; or a ValueError saying what it cannot (before any work)."""
    if type_name not in TYPES:
        raise ValueError(f"--type: expected one of {', '.join(TYPES)}, got {type_name!r}")
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json; expected an HF model folder (e.g. artifacts/merged)")
    config = read_json(Path(model_dir) / "config.json")
    if problem := architecture_problem(config):
        raise ValueError(f"{model_dir}/config.json: {problem}; --type {type_name} cannot be written for it")
    tokenizer_json = Path(model_dir) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json; the GGUF file carries the tokenizer")
    if read_json(tokenizer_json)["model"]["type"] != "BPE":
        raise ValueError(f"{tokenizer_json}: the exporter writes byte-level BPE tokenizers, got another model")
    config["pre_tokenizer"] = pre_tokenizer(Path(model_dir))
    return config


def architecture_problem(config: dict) -> str | None:
    """Why a model of `config` (config.json's fields) cannot become a GGUF file that computes what it computes, or
    None (also `check`'s answer for export.gguf, before anything trains)."""
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        names = ", ".join(config.get("architectures") or [])
        return f"model_type {kind!r} ({names}): the GGUF exporter knows {', '.join(ARCHITECTURES)}"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope_type {rope['rope_type']!r}: only unscaled rotary embeddings are exported"
    if config.get("mlp_bias"):
        return "mlp_bias: biases of the MLP are not exported"
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        return (
            f"sliding_window {config['sliding_window']}: GGUF's {ARCHITECTURES[kind]} attends to the whole "
            "context, so the file would compute something else"
        )
    if kind == "qwen3" and config.get("head_dim", READ_QWEN3_HEAD_DIM) != READ_QWEN3_HEAD_DIM:
        return (
            f"head_dim {config['head_dim']}: transformers' GGUF reader (the export's proof) builds Qwen3 with "
            f"head_dim {READ_QWEN3_HEAD_DIM}, as every released Qwen3 has it"
        )
    return None


def pre_tokenizer(model_dir: Path) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for how the folder's tokenizer, as transformers loads it, splits text
    before its byte-level merges: GPT-2's split, or one of the splits transformers' GGUF reader knows by name (Qwen2,
    Llama 3 ...); a ValueError for any other."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from pipeline.data.tokenizer import load_tokenizer

    split = json.loads(load_tokenizer(model_dir).backend_tokenizer.to_str())["pre_tokenizer"] or {}
    if split.get("type") == "ByteLevel" and split.get("use_regex", True):
        return "gpt2"
    steps = split.get("pretokenizers", [])
    if [step.get("type") for step in steps] == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = steps[0].get("pattern", {}).get("Regex")
        named = [name for name, known in GGUF_PRE_TOKENIZER_SPLITS.items() if known == regex]
        if named:
            return named[0]
    raise ValueError(
        f"{model_dir}: its tokenizer splits text as {json.dumps(split)[:160]}; the exporter writes byte-level BPE "
        "tokenizers with GPT-2's split or one llama.cpp names (Qwen2's, Llama 3's ...)"
    )


def rope_rows_interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder the rows (a bias's entries) of q_proj/k_proj (`heads` heads of d rows: d/2 first halves, then d/2
    second halves) so that each head's rows pair up as (0, d/2), (1, d/2 + 1), ...: GGML's rotary layout."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, -1).transpose(0, 2, 1, 3).reshape(weight.shape)


def tensor_names(architecture: str, blocks: int):
    """llama.cpp's map of HF tensor names to GGUF's for the GGUF `architecture` (as the gguf package holds it)."""
    import gguf

    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    return gguf.get_tensor_name_map(arch, blocks)


def gguf_name(hf_name: str, *, names, tied: bool) -> str | None:
    """The GGUF name of the HF tensor `hf_name` by llama.cpp's map `names` (None: not stored: a tied head)."""
    if hf_name == "lm_head.weight" and tied:
        return None
    found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise ValueError(f"tensor {hf_name}: llama.cpp's architecture has no place for it; expected its tensors")
    return found


def vocabulary(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens as tokenizer.json spells them (byte-level strings), and their GGUF token types; embedding rows past
    the tokenizer (padding) become unused tokens."""
    import gguf

    spec = read_json(Path(model_dir) / "tokenizer.json")
    by_id = {i: token for token, i in spec["model"]["vocab"].items()}
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id.update({i: t["content"] for i, t in added.items()})
    if max(by_id) >= vocab_size:
        raise ValueError(f"{model_dir}: the tokenizer has ids up to {max(by_id)}, the model only {vocab_size} rows")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _plan(model_dir: Path, config: dict, type_name: str) -> list[tuple[str, str, Path, tuple, str]]:
    """(gguf name, hf name, shard, shape, storage) for every stored tensor, from the shards' headers only."""
    from safetensors import safe_open

    tied = bool(config.get("tie_word_embeddings", False))
    names = tensor_names(ARCHITECTURES[config["model_type"]], config["num_hidden_layers"])
    plan = []
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = gguf_name(name, names=names, tied=tied)
                if target is None:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                storage = "f32" if len(shape) == 1 else type_name
                if storage == "q8_0" and shape[-1] % Q8_BLOCK:
                    storage = "f16"
                plan.append((target, name, shard, shape, storage))
    if not plan:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights")
    return sorted(plan, key=lambda p: _order(p[0]))


def _order(name: str) -> tuple:
    """Embeddings, then blocks in order, then the output norm and head (as llama.cpp's files hold them)."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def _stored(array: np.ndarray, storage: str) -> tuple[np.ndarray, object]:
    """The bytes GGUF stores for one tensor, and its GGML type."""
    import gguf

    if storage == "f32":
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if storage == "f16":
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0


def _nbytes(shape: tuple, storage: str) -> int:
    count = int(np.prod(shape))
    if storage == "q8_0":
        return count // Q8_BLOCK * Q8_BLOCK_BYTES
    return count * (4 if storage == "f32" else 2)


def _write_metadata(writer, model_dir: Path, config: dict, type_name: str) -> None:
    import gguf

    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(Path(model_dir).resolve().name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[type_name]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types = vocabulary(model_dir, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(config["pre_tokenizer"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)  # merges, bos/eos/unk/pad ids, the chat template
    if "bos" not in special.add_special_token:
        writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)


def export_gguf(*, model_dir: Path, out: Path, type_name: str) -> dict:
    """Write `out` (atomically); returns what was written: tensors per storage type and the file's size."""
    import gguf
    from safetensors import safe_open

    config = check_exportable(model_dir, type_name)
    plan = _plan(model_dir, config, type_name)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    architecture = ARCHITECTURES[config["model_type"]]
    interleaved = architecture in INTERLEAVED_ROTARY
    counts: dict[str, int] = {}
    with atomic_path(Path(out)) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch=architecture)
        _write_metadata(writer, model_dir, config, type_name)
        for target, _, _, shape, storage in plan:
            dtype = {"f32": np.float32, "f16": np.float16, "q8_0": np.uint8}[storage]
            byte_shape = (*shape[:-1], shape[-1] // Q8_BLOCK * Q8_BLOCK_BYTES) if storage == "q8_0" else shape
            raw = gguf.GGMLQuantizationType.Q8_0 if storage == "q8_0" else None
            writer.add_tensor_info(target, byte_shape, np.dtype(dtype), _nbytes(shape, storage), raw_dtype=raw)
            counts[storage] = counts.get(storage, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for target, name, shard, _, storage in plan:
            with safe_open(shard, "pt") as f:
                array = f.get_tensor(name).float().numpy()
            if interleaved and target.endswith(("attn_q.weight", "attn_q.bias")):
                array = rope_rows_interleaved(array, heads)
            elif interleaved and target.endswith(("attn_k.weight", "attn_k.bias")):
                array = rope_rows_interleaved(array, kv_heads)
            data, _ = _stored(array, storage)
            writer.write_tensor_data(data)
        writer.close()
    return {"tensors": counts, "bytes": Path(out).stat().st_size, "type": type_name}
