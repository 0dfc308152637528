"""Model cards: the Hugging Face format (YAML header, Markdown body) with the data, the config that produced the model,
its figures and the commands that load it; nothing that changes from one identical run to the next."""

from __future__ import annotations

import yaml

from pipeline import config, model_card
from tests.conftest import REPO

DATASET = {
    "documents": 120, "tokens": 5000, "train_rows": 70, "validation_rows": 8, "masked_fraction": 0.0,
    "sources": {
        "peoples_daily_train": {"planned_share": 0.75, "realised_share": 0.7481, "train_tokens": 3700, "items": 90},
        "enwiki_train": {"planned_share": 0.25, "realised_share": 0.2519, "train_tokens": 1246, "items": 30},
    },
}  # fmt: skip
TRAINING = {"steps": 20, "val_loss": 2.645785, "val_perplexity": 14.094501, "tokens_per_s": 154.6, "precision": "bf16"}


def _parts(card: str) -> tuple[dict, str]:
    _, header, body = card.split("---\n", 2)
    return yaml.safe_load(header), body


def test_adapter_card_has_the_format_and_the_facts():
    params = config.validate(config.compose(REPO / "conf", ["experiment=cpt_mix"])).model_dump()
    card = model_card.render(kind="adapter", params=params, dataset=DATASET, training=TRAINING)
    header, body = _parts(card)
    assert header["base_model"] == params["model"]["path"] and header["library_name"] == "peft"
    assert header["license"] == "other" and {"lora", "peft", "data-text"} <= set(header["tags"])
    config_block = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(config_block) == {k: params[k] for k in model_card.CONFIG_SECTIONS}
    assert "| enwiki_train | `data/corpus/enwiki_train.txt` | text | 1.0 | 0.25 | 0.2519 |" in body
    assert "| val_loss | 2.645785 |" in body and "tokens_per_s" not in body, "no timings: a re-run writes the same"
    assert 'PeftModel.from_pretrained(base, "artifacts/adapter")' in body
    assert card == model_card.render(kind="adapter", params=params, dataset=DATASET, training=TRAINING)


def test_merged_card_and_the_vocabulary_extension(tmp_path):
    params = config.validate(config.compose(REPO / "conf", ["experiment=extend_vocab"])).model_dump()
    merge = {"max_abs_logit_diff": 3.1e-05, "mean_kl": 1.8e-09, "vocab_rows": 56704}
    card = model_card.render(kind="merged", params=params, dataset=DATASET, training=TRAINING, merge=merge)
    header, body = _parts(card)
    assert header["library_name"] == "transformers" and "merged" in header["tags"]
    assert "| max_abs_logit_diff | 3.1e-05 |" in body and 'from_pretrained("artifacts/merged")' in body
    adapter = model_card.render(kind="adapter", params=params, dataset=DATASET, training=TRAINING)
    assert "resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)" in adapter
    model_card.write(tmp_path, card)
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == card
