"""Token-weighted corpus likelihood with a sliding window, as perplexity and bits per byte, and greedy samples.

Each document is scored from its first token, conditioned on a prefix token (BOS, else EOS), as
lm-evaluation-harness's `loglikelihood_rolling` does; windows of `context` tokens advance by `stride`, so every
token is scored exactly once with at least context - stride tokens of history (stride == context reproduces the
harness's disjoint windows). Bits per byte = total NLL / (ln 2 x UTF-8 bytes): comparable across tokenizers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch

from pipeline.checkpoints import adapter
from pipeline.data.encoding import encode
from pipeline.data.examples import IGNORE_INDEX
from pipeline.data.inputs import items, resolved_format
from pipeline.data.templates import sft_segments
from pipeline.model import tiled_mlp


@dataclass(frozen=True)
class Example:
    """Token ids (prefix included) and which of them are scored; `nbytes` counts the scored text."""

    ids: list[int]
    scored: list[bool]
    nbytes: int


@dataclass(frozen=True)
class Score:
    nll: float
    tokens: int
    nbytes: int

    def as_dict(self) -> dict:
        return {
            "perplexity": math.exp(self.nll / self.tokens),
            "bits_per_byte": self.nll / (math.log(2) * self.nbytes),
            "tokens": self.tokens,
            "bytes": self.nbytes,
        }


def prefix_token(tokenizer) -> int:
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("tokenizer: neither a BOS nor an EOS token to condition the first scored token on")
    return token


def text_examples(tokenizer, path: Path, max_bytes: int | None) -> list[Example]:
    """Whole documents of a text data path (one per non-blank line, or JSON rows' "text") while they fit in
    `max_bytes` (at least one), read a document at a time."""
    return _documents(tokenizer, _nonempty(items(path, "text"), path), max_bytes)


def set_examples(
    tokenizer, found: Iterable, *, data_format: str, template: str, max_bytes: int | None
) -> list[Example]:
    """A set's examples from its items (read no further than `max_bytes` of scored text, at least one example):
    text documents scored whole; instruction rows (alpaca, chat) scored on their responses, the prompts being
    context; prompt-completion rows on the completion, preference pairs on the chosen response (each the last
    reply), as `data.format` trains on them."""
    if data_format == "text":
        return _documents(tokenizer, found, max_bytes)
    if data_format in ("preference", "prompt_completion"):
        from pipeline.data.examples import completion_examples, pair_examples

        examples = pair_examples if data_format == "preference" else completion_examples
        last = (examples([row])[0] for row in found)
        return _rows(tokenizer, last, template=template, max_bytes=max_bytes, final_reply_only=True)
    return _rows(tokenizer, found, template=template, max_bytes=max_bytes, final_reply_only=False)


def _documents(tokenizer, documents: Iterable[str], max_bytes: int | None) -> list[Example]:
    kept, total = [], 0
    for doc in documents:
        size = len(doc.encode("utf-8"))
        if kept and max_bytes is not None and total + size > max_bytes:
            break
        kept.append(doc)
        total += size
    prefix = prefix_token(tokenizer)
    return [
        Example([prefix, *ids], [False] + [True] * len(ids), len(doc.encode("utf-8")))
        for doc, ids in zip(kept, encode(tokenizer, kept, add_special_tokens=False), strict=True)
    ]


def _rows(
    tokenizer, rows: Iterable[dict], *, template: str, max_bytes: int | None, final_reply_only: bool
) -> list[Example]:
    """Instruction rows: only the response tokens are scored (and their bytes counted); with `final_reply_only`,
    only a conversation's last reply."""
    examples, total = [], 0
    for row in rows:
        ids, scored, nbytes = [], [], 0
        segments = sft_segments(tokenizer, row, template)
        last = max((i for i, (_, trained) in enumerate(segments) if trained), default=-1) if final_reply_only else None
        for i, (text, trained) in enumerate(segments):
            trained = trained and (last is None or i == last)
            piece = encode(tokenizer, [text], add_special_tokens=False)[0]
            ids += piece
            scored += [trained] * len(piece)
            nbytes += len(text.encode("utf-8")) if trained else 0
        if examples and max_bytes is not None and total + nbytes > max_bytes:
            break
        examples.append(Example(ids, scored, nbytes))
        total += nbytes
    return examples


def _nonempty(found: Iterable, path: Path | str) -> Iterator:
    """`found`, refused (naming `path`) when it holds nothing."""
    found = iter(found)
    first = next(found, None)
    if first is None:
        raise ValueError(f"{path}: data file is empty")
    return chain([first], found)


def windows(example: Example, context: int, stride: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per window, labels aligned with the logits (label i = the token logit i predicts,
    -100 unless scored here). The first window predicts `context` tokens, each later one the next `stride`."""
    ids, out, first, n = example.ids, [], 1, len(example.ids)
    while first < n:
        last = min(first + (context if first == 1 else stride), n)  # targets [first, last)
        begin = max(0, last - 1 - context)
        labels = [ids[j] if j >= first and example.scored[j] else IGNORE_INDEX for j in range(begin + 1, last)]
        out.append((ids[begin : last - 1], labels))
        first = last
    return out


LOGIT_BYTES = {"cpu": 1 << 26, "cuda": 1 << 30}  # fp32 logits computed at a time (batch x positions x vocabulary x 4)
# Config attributes of heads that do more than a linear map (their logits come from the model's own forward).
HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_nll(model, ids: torch.Tensor, labels: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """-log p of every position's label (0 where the label is -100), flattened in (row, position) order. The head
    runs on `chunk` positions at a time (default: LOGIT_BYTES of fp32 logits for the head's device), so that batch x
    window x vocabulary logits never exist in fp32 at once. The result is on the head's device: a model spread over
    GPUs ends there, whatever device its inputs came from."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal.get_output_embeddings()
    if any(getattr(causal.config, name, None) for name in HEAD_EXTRAS) or head is None:
        logits = model(input_ids=ids).logits.float()
        return positions_nll(logits, labels.to(logits.device))
    hidden = causal.get_decoder()(input_ids=ids).last_hidden_state
    device = head.weight.device
    budget = LOGIT_BYTES["cuda" if device.type == "cuda" else "cpu"]
    chunk = chunk or max(1, budget // (4 * ids.shape[0] * head.weight.shape[0]))
    hidden, labels = hidden.to(device), labels.to(device)  # the decoder may end on another GPU than the head
    parts = []
    for start in range(0, ids.shape[1], chunk):
        logits = head(hidden[:, start : start + chunk]).float()
        parts.append(positions_nll(logits, labels[:, start : start + chunk]).view(ids.shape[0], -1))
    return torch.cat(parts, dim=1).reshape(-1)


def positions_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log p of each label (0 at -100) from batch x positions x vocabulary logits, flattened in (row, position)
    order: over rows of the vocabulary, contiguous (cross_entropy over the vocabulary as dimension 1 of a transposed
    view, as before, took 2.7-3.7x as long on a CPU, 104 against 28-38 ms for 4 x 64 positions of 49,152, and its
    sums drifted: -1.4e-4 nats a token from the float64 value on the default experiment's merged model, -1.7e-5 now)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")


def score(
    model: torch.nn.Module | list[torch.nn.Module],
    examples: list[Example],
    *,
    context: int,
    stride: int,
    batch_size: int,
    desc: str | None = None,
    chunk: int | None = None,
) -> Score:
    """Sum of -log p over scored tokens, batched by length, in inference mode (a progress bar when `desc`). Given
    replicas of the model (one per GPU: `load_replicas`), each scores every n-th batch in a thread of its own (the
    GPUs' kernels run side by side); the sum is taken in batch order, so it is the one replica's to the last bit."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    replicas = model if isinstance(model, list) else [model]
    for replica in replicas:  # long windows (the trained length of a long-context run): memory bounded by a tile
        tiled_mlp.install_for_window(replica, context)
    items = sorted((w for e in examples for w in windows(e, context, stride)), key=lambda w: -len(w[0]))
    batches = [items[start : start + batch_size] for start in range(0, len(items), batch_size)]
    bar = tqdm(total=len(items), desc=desc, disable=desc is None, dynamic_ncols=True)

    def scored(k: int) -> dict[int, float]:
        replica = replicas[k]
        device = next(replica.parameters()).device
        sums = {}
        with torch.inference_mode():
            for index in range(k, len(batches), len(replicas)):
                ids, labels = tensors(batches[index])
                sums[index] = float(token_nll(replica, ids.to(device), labels.to(device), chunk).sum())
                bar.update(len(batches[index]))
        return sums

    if len(replicas) == 1:
        sums = scored(0)
    else:
        with ThreadPoolExecutor(len(replicas)) as pool:
            sums = {i: nll for part in pool.map(scored, range(len(replicas))) for i, nll in part.items()}
    bar.close()
    tokens = sum(int(label != IGNORE_INDEX) for _, labels in items for label in labels)
    return Score(sum(sums[i] for i in range(len(batches))), tokens, sum(e.nbytes for e in examples))


def tensors(batch: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of one batch right-padded into (ids, labels), the labels of the padding -100."""
    width = len(batch[0][0])
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    for i, (window_ids, window_labels) in enumerate(batch):
        ids[i, : len(window_ids)] = torch.tensor(window_ids)
        labels[i, : len(window_labels)] = torch.tensor(window_labels)
    return ids, labels


def greedy_samples(model, tokenizer, *, prompts: list[str], max_new_tokens: int) -> list[str]:
    device = next(model.parameters()).device
    texts = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
            out = model.generate(
                input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=prefix_token(tokenizer)
            )
            texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def load_model(model_dir: Path, adapter_dir: Path | None, *, precision: str = "auto"):
    """A model folder, optionally with a PEFT adapter (the base resized to the adapter's vocabulary first), in bf16
    where the hardware computes it natively (`precision` auto; see pipeline/core/precision.py) else fp32, placed by
    `device_maps`: on the CPU, on the freest GPU, or spread over the GPUs only where none holds it."""
    return load_replicas(model_dir, adapter_dir, precision=precision, most=1)[0]


def load_replicas(model_dir: Path, adapter_dir: Path | None, *, precision: str = "auto", most: int | None = None):
    """`load_model`'s model on each GPU that holds it whole (at most `most`), for data-parallel scoring; one model
    where there is no GPU or none holds it."""
    from pipeline.core.precision import inference_dtype
    from pipeline.model import pretrained

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json; expected an HF model folder")
    cuda = torch.cuda.is_available()
    dtype = inference_dtype(precision, "cuda" if cuda else "cpu")
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())] if cuda else []
    models = []
    for placement in device_maps(model_bytes(model_dir, dtype), free)[:most]:
        model = pretrained.causal_lm(model_dir, dtype=dtype, device_map=placement)
        models.append((with_adapter(model, adapter_dir) if adapter_dir is not None else model).eval())
    return models


FIT = 0.8  # share of a GPU's free memory the weights may take when the whole model goes on one GPU


def device_maps(weight_bytes: int, free_bytes: list[int]) -> list[dict | str | None]:
    """Where the model's replicas go: the CPU without GPUs ([None]); a whole model on each GPU where its weights fit
    in FIT of the free memory, the freest first (the GPUs of a spread model run one at a time, so whole replicas
    score as many batches at once as there are GPUs); spread over every GPU (accelerate's "auto") only where no GPU
    holds it."""
    if not free_bytes:
        return [None]
    freest_first = sorted(range(len(free_bytes)), key=lambda i: -free_bytes[i])
    return [{"": i} for i in freest_first if weight_bytes <= FIT * free_bytes[i]] or ["auto"]


def model_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The model's weights in `dtype`, from its safetensors headers (nothing loaded)."""
    from pipeline.checkpoints import model_files

    elements = sum(math.prod(t.shape) for t in model_files.model_tensors(model_dir).values())
    return elements * dtype.itemsize


def with_adapter(model, adapter_dir: Path):
    """`model` with the PEFT adapter of `adapter_dir` applied (its embeddings resized to the adapter's first). PEFT's
    loader reads the adapter as it is when its names are the ones PEFT saves; otherwise (no `base_model.model.`
    prefix, adapter names left in) from a copy under those names in a temporary folder."""
    import shutil
    import tempfile

    from peft import PeftModel

    from pipeline.checkpoints.safetensors_stream import write

    if not (adapter_dir / adapter.CONFIG).is_file():
        raise FileNotFoundError(f"{adapter_dir}: no {adapter.CONFIG}; expected a PEFT adapter folder")
    tensors, as_saved = adapter.read_tensors(adapter_dir)
    modules = {id(m): n for n, m in model.named_modules()}
    embed = f"{adapter.PREFIX}{modules[id(model.get_input_embeddings())]}.weight"
    if embed in tensors and tensors[embed].shape[0] != model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(tensors[embed].shape[0], mean_resizing=False)
    if as_saved and adapter.weights_file(adapter_dir).name == adapter.WEIGHTS:  # PEFT would unpickle a .bin itself
        return PeftModel.from_pretrained(model, str(adapter_dir))
    with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
        entries = [(key, tuple(t.shape), t.dtype) for key, t in tensors.items()]
        write(Path(tmp) / adapter.WEIGHTS, entries, lambda key: tensors[key].read().contiguous())
        shutil.copy2(adapter_dir / adapter.CONFIG, Path(tmp) / adapter.CONFIG)
        return PeftModel.from_pretrained(model, tmp)


def check_vocabulary(tokenizer, model, where: str) -> None:
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ValueError(
            f"{where}: the tokenizer has {len(tokenizer)} tokens but the model only {rows} embedding rows; "
            "expected the tokenizer the model was trained with"
        )


def load_examples(
    tokenizer,
    path: Path,
    *,
    template: str,
    max_bytes: int | None,
    context: int,
    key: str,
    data_format: str = "auto",
) -> list[Example]:
    """A set's examples (`set_examples`), its items read as `data_format` (auto: as its first row shows; plain text
    is text); a text set must fill one window."""
    try:
        data_format = resolved_format(data_format, path)
        examples = set_examples(
            tokenizer, _nonempty(items(path, data_format), path), data_format=data_format, template=template,
            max_bytes=max_bytes,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"{key}: {err}") from None
    scored = sum(sum(e.scored) for e in examples)
    short = data_format == "text" and sum(len(e.ids) for e in examples) < context
    if short or scored == 0:
        raise ValueError(
            f"{key}: {path} gives {sum(len(e.ids) for e in examples)} tokens ({scored} scored), "
            + (f"shorter than one window (eval.context = {context}); expected more text" if short else "none scored")
        )
    return examples
