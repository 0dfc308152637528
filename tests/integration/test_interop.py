"""Interoperability of consolidate and convert: checkpoints written without our trainer (a bare deepspeed.initialize
with each optimizer DeepSpeed builds, tests/helpers/interop_engine_worker.py, on 3 ranks; HF Trainer with a DeepSpeed
config as LLaMA-Factory drives it, tests/helpers/interop_trainer_worker.py, on 2; two launches in all) consolidate into
adapters equal to the live engines' fp32 masters that PEFT loads, convert to the universal layout with Adam's moments,
and folders that are not one save of one layout are refused with the files named and nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoints.adapter import CONFIG, WEIGHTS, peft_key
from pipeline.checkpoints.consolidate import MANIFEST, consolidate
from pipeline.checkpoints.universal import to_universal
from pipeline.core.atomic import read_json
from pipeline.core.environment import free_port, with_venv_path
from pipeline.launching.ops import remove_stale_shm_buffers
from tests.conftest import REPO
from tests.helpers.interop_engine_worker import CASES, tiny_llama
from tests.helpers.interop_trainer_worker import CASES as TRAINER_CASES

pytestmark = pytest.mark.integration
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What the manifest names the engine's optimizer, by the class the live engine used.
WRAPPERS = {"FusedAdam": "none (fp32 module)"}
ENGINE_RANKS = 3


def _launch(module: str, out: Path, ranks: int) -> None:
    command = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()), "--module", module]
    command += ["--out", str(out)]
    env = {**with_venv_path(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    remove_stale_shm_buffers()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    """One launch: every case of the bare-engine worker, on 3 ranks (odd partitions)."""
    out = tmp_path_factory.mktemp("engines")
    _launch("tests.helpers.interop_engine_worker", out, ENGINE_RANKS)
    return out


@pytest.fixture(scope="module")
def trainers(tmp_path_factory) -> Path:
    """One launch: every case of the HF Trainer worker, 2 ranks."""
    out = tmp_path_factory.mktemp("trainers")
    _launch("tests.helpers.interop_trainer_worker", out, 2)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny LLaMA the workers train (same seed), as save_pretrained writes it: no tokenizer."""
    out = tmp_path_factory.mktemp("interop_base")
    tiny_llama().save_pretrained(str(out))
    return out


def _assert_equals_live(adapter: Path, live_file: Path, base: Path, precision: str, low_masters: bool = False) -> None:
    """The adapter holds the live engine's fp32 masters under PEFT's names, and PEFT loads them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    live = load_file(live_file)
    masters = {k: v for k, v in live.items() if "#" not in k}
    written = load_file(adapter / WEIGHTS)
    assert set(written) == {peft_key(name) for name in masters}
    for name, value in masters.items():
        assert torch.equal(written[peft_key(name)], value), name
        assert torch.equal(value.to(LOW[precision]).float(), live[f"{name}#lp"]), f"{name}: masters round to it"
    if precision != "fp32" and not low_masters:  # the masters, not the module's rounded values
        assert any(not torch.equal(v, live[f"{n}#lp"]) for n, v in masters.items())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[name], value) for name, value in masters.items())


@pytest.mark.parametrize("case", list(CASES))
def test_bare_engine_checkpoint_consolidates_to_the_live_masters(engines, base, tmp_path, case):
    stage, precision, *_ = CASES[case]
    bf16_masters = "bf16_masters" in case
    manifest = consolidate(checkpoint_dir=engines / case, output_dir=tmp_path / "adapter")
    _assert_equals_live(tmp_path / "adapter", engines / case / "live.safetensors", base, precision, bf16_masters)
    wrapper = (engines / case / "wrapper.txt").read_text()
    assert manifest["layout"]["optimizer"] == WRAPPERS.get(wrapper, wrapper)
    assert (manifest["source"]["zero_stage"], manifest["source"]["world_size"]) == (stage, ENGINE_RANKS)
    assert manifest["layout"]["master_dtype"] == ("bfloat16" if bf16_masters else "float32")
    assert any("keeps no fp32 masters" in note for note in manifest["notes"]) == bf16_masters
    legacy = [note for note in manifest["notes"] if "legacy torch serialization" in note]
    assert len(legacy) == (1 + ENGINE_RANKS if "legacy" in case else 0)


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_hf_trainer_output_dir_consolidates_its_newest_checkpoint(trainers, base, tmp_path, case):
    manifest = consolidate(checkpoint_dir=trainers / case, output_dir=tmp_path / "adapter")
    assert manifest["notes"][0].endswith("picked checkpoint-2, the newest of 2 HF Trainer checkpoint folder(s) (by N)")
    assert manifest["source"]["tag"] == "global_step2" and manifest["source"]["step"] == 2
    _assert_equals_live(tmp_path / "adapter", trainers / case / "live.safetensors", base, TRAINER_CASES[case][1])
    wrapper = (trainers / case / "wrapper.txt").read_text()
    assert manifest["layout"]["optimizer"] == WRAPPERS.get(wrapper, wrapper)
    # the checkpoint-N folder itself, and the tag folder itself, with the config found beside the tag
    first = consolidate(checkpoint_dir=trainers / case / "checkpoint-1", output_dir=tmp_path / "first")
    assert first["source"]["step"] == 1 and first["notes"] == []
    again = consolidate(checkpoint_dir=trainers / case / "checkpoint-2" / "global_step2", output_dir=tmp_path / "tag")
    assert again["tensors"] == manifest["tensors"]


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0] > 0] + ["llamafactory_z2_bf16_client"])
def test_convert_writes_the_live_masters_and_moments(engines, trainers, tmp_path, case):
    folder = trainers / case / "checkpoint-2" if case in TRAINER_CASES else engines / case
    manifest = to_universal(folder / "global_step2", tmp_path / "universal")
    assert manifest["step"] == 2
    live = load_file((trainers if case in TRAINER_CASES else engines) / case / "live.safetensors")
    for key, value in live.items():
        name, _, kind = key.partition("#")
        if kind != "lp":
            saved = torch.load(tmp_path / "universal" / "zero" / name / f"{kind or 'fp32'}.pt", weights_only=True)
            assert torch.equal(saved["param"].float(), value), key


def test_cli_reads_a_tag_folder_and_says_where_from(engines, tmp_path):
    tag = engines / "z0_bf16_fused_frozen_saved" / "global_step2"
    out = tmp_path / "adapter"
    command = [sys.executable, "-m", "pipeline", "consolidate", str(tag), str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"(ZeRO-0, {ENGINE_RANKS} rank(s), FP16_Optimizer, float32 masters)" in done.stdout
    assert read_json(out / MANIFEST)["source"]["tag"] == "global_step2"


def _copy(root: Path, case: str, tmp_path: Path) -> Path:
    shutil.copytree(root / case, tmp_path / case)
    return tmp_path / case


def _bf16_and_fp32_optimizer_shards(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(engines, "z2_bf16_elastic_aligned", tmp_path)
    stray = engines / "z1_fp16_config" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copy(stray, folder / "global_step2")
    return folder, "holds shard files of two saves (optimizer (bf16 engine): ['bf16_zero_pp_rank_0_mp_rank_00_optim"


def _zero3_model_file_beside_zero2(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(engines, "z2_bf16_round_robin_client", tmp_path)
    stray = engines / "z3_fp32_offload_client" / "global_step2" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shutil.copy(stray, folder / "global_step2")
    return folder, "model (ZeRO-3, one per rank): ['zero_pp_rank_1_mp_rank_00_model_states.pt']"


def _optimizer_shards_beside_zero0(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(engines, "z0_bf16_fused_frozen_saved", tmp_path)
    for path in (engines / "z2_bf16_elastic_aligned" / "global_step2").glob("*optim_states.pt"):
        shutil.copy(path, folder / "global_step2")
    return folder, "is a ZeRO-0 save (its optimizer kept whole) beside optimizer shards of a partitioned one"


def _rank_of_another_run(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(engines, "z2_bf16_elastic_aligned", tmp_path)
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(engines / "z2_bf16_bf16_masters" / "global_step2" / name, folder / "global_step2" / name)
    return folder, f"(ds_config differs between mp_rank_00_model_states.pt and {name} in ['bf16', 'zero_optimization'])"


def _nvme_offload(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(engines, "z3_fp32_offload_client", tmp_path)
    (folder / "global_step2" / "offloaded_tensors" / "rank00").mkdir(parents=True)
    return folder, "offloaded_tensors: ZeRO-3 optimizer state offloaded to NVMe"


def _truncated_legacy_file(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(engines, "z2_bf16_legacy_offload", tmp_path)
    path = folder / "global_step2" / "mp_rank_00_model_states.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return folder, f"{path}: cannot be read as a DeepSpeed shard (truncated or corrupted?)"


def _config_of_another_model(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(engines, "z0_bf16_unfused_two_groups", tmp_path)
    config = read_json(folder / CONFIG)
    (folder / CONFIG).write_text(json.dumps({**config, "r": 8}))
    return folder, "LoRA module model.layers.0.self_attn.q_proj has rank 3, the adapter config says 8"


def _universal_folder(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    to_universal(engines / "z1_fp16_config" / "global_step2", tmp_path / "universal")
    return tmp_path / "universal", "a universal checkpoint (zero/<parameter>/fp32.pt"


def _deepspeed_chat_lora(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    """A DeepSpeed-Chat run that added engine.save_checkpoint: fp16 ZeRO-0 with FusedAdam (its defaults), its own
    LoRA layers (`lora_right_weight` = A^T, `lora_left_weight` = B^T) in place of PEFT's."""
    folder = _copy(engines, "z0_fp16_fused", tmp_path)
    path = folder / "global_step2" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    renames = {".lora_A.default.weight": ".lora_right_weight", ".lora_B.default.weight": ".lora_left_weight"}
    for old, new in renames.items():
        state["module"] = {k.replace(old, new): v for k, v in state["module"].items()}
    torch.save(state, path)
    return folder, "holds DeepSpeed-Chat's own LoRA layers (base_model.model.model.layers.0.mlp.up_proj.lora_left"


def _deepspeed_chat_output(engines: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = tmp_path / "dschat"
    folder.mkdir()
    model = tiny_llama()
    model.config.save_pretrained(str(folder))
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # as DeepSpeed-Chat's save_hf_format writes it
    return folder, "no DeepSpeed checkpoint: DeepSpeed-Chat, like save_pretrained, writes merged weights"


def _save_only_model(trainers: Path, tmp_path: Path) -> tuple[Path, str]:
    folder = _copy(trainers / "hf_z0_bf16_config", "checkpoint-2", tmp_path)
    shutil.rmtree(folder / "global_step2")
    (folder / "latest").unlink()
    return folder, "holds a PEFT adapter (adapter_model.safetensors) but no DeepSpeed checkpoint"


@pytest.mark.parametrize(
    "damage",
    [
        _bf16_and_fp32_optimizer_shards, _zero3_model_file_beside_zero2, _optimizer_shards_beside_zero0,
        _rank_of_another_run, _nvme_offload, _truncated_legacy_file, _config_of_another_model,
        _universal_folder, _deepspeed_chat_lora, _deepspeed_chat_output, _save_only_model,
    ],
)  # fmt: skip
def test_foreign_bad_input_is_refused_and_nothing_written(engines, trainers, tmp_path, damage):
    root = trainers if damage is _save_only_model else engines
    folder, message = damage(root, tmp_path)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        consolidate(checkpoint_dir=folder, output_dir=tmp_path / "adapter")
    assert message in str(err.value)
    assert not (tmp_path / "adapter").exists()


def test_cli_refuses_a_folder_without_a_checkpoint_in_one_line(engines, tmp_path):
    folder, message = _deepspeed_chat_output(engines, tmp_path)
    out = tmp_path / "adapter"
    command = [sys.executable, "-m", "pipeline", "consolidate", str(folder), str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


def test_cli_convert_reads_an_hf_trainer_output_dir(trainers, tmp_path):
    out = tmp_path / "universal"
    command = [sys.executable, "-m", "pipeline", "convert", str(trainers / "hf_z3_bf16_config"), str(out)]
    done = subprocess.run([*command, "--to", "universal"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "picked checkpoint-2, the newest of 2 HF Trainer checkpoint folder(s)" in done.stdout
    assert read_json(out / "universal_manifest.json")["source"]["zero_stage"] == 3
