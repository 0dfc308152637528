"""The checkpoint loader (pipeline/checkpoints/safe_pickle.py): torch's weights-only loader with the checkpoint
classes and the bounds of our own around it. Every payload of tests/helpers/crafted_pickles.py, written from pickle's
own opcode table, is live under Python's unpickler and refused with its construct named and nothing run; so is every
whole crafted file (a TorchScript archive that writes a file as torch.load opens it, a DEFLATE bomb, stride tricks);
data that torch.save writes (zip and legacy formats) loads as torch's weights-only loader loads it; and what torch's
loader does not bound (hashing bombs, deep nesting, storages against the file, views against their storage, object
dtypes, RNG states of the wrong shape) is refused."""

from __future__ import annotations

import argparse
import copyreg
import io
import pickle
import pickletools
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from pipeline.checkpoints import engine_loads, folder, pickle_scan, safe_pickle
from tests.conftest import REPO
from tests.helpers import crafted_pickles as crafted
from tests.helpers.crafted_pickles import OP, text

EMPTY_DICT = OP["PROTO"] + b"\x02" + OP["EMPTY_DICT"] + OP["STOP"]


@pytest.fixture
def registered_extension():
    """posix.system under crafted.EXT_CODE in copyreg's registry, as another library might have left it."""
    copyreg.add_extension("posix", "system", crafted.EXT_CODE)
    yield
    copyreg.remove_extension("posix", "system", crafted.EXT_CODE)


@pytest.fixture
def base_file(tmp_path):
    path = tmp_path / "base.pt"
    torch.save({"t": torch.arange(4.0)}, path)
    return path


def test_every_payload_runs_its_command_under_pythons_unpickler(tmp_path):
    """The payloads are real: Python's pickle.loads (in a child process) runs each live one's `touch`."""
    markers = {}
    for i, construct in enumerate(crafted.payloads(tmp_path / "m")):
        if crafted.live(construct):
            markers[construct] = tmp_path / f"marker{i}"
            blob = crafted.splice(EMPTY_DICT, "x", crafted.payloads(markers[construct])[construct][0])
            (tmp_path / f"case{i}.pkl").write_bytes(blob)
    script = (
        "import copyreg, pickle, sys, torch, numpy, deepspeed.runtime.engine\n"
        f"copyreg.add_extension('posix', 'system', {crafted.EXT_CODE})\n"
        "for path in sys.argv[1:]:\n"
        "    try: pickle.loads(open(path, 'rb').read())\n"
        "    except Exception: pass\n"
    )
    cases = sorted(tmp_path.glob("case*.pkl"))
    subprocess.run([sys.executable, "-c", script, *map(str, cases)], cwd=REPO, check=True, capture_output=True)
    assert len(markers) >= 15 and [c for c, m in markers.items() if not m.exists()] == []


def test_an_object_dtype_payload_crashes_pythons_unpickler():
    """What the numpy payload is under Python's unpickler: an array whose item is the forged pointer 0x4141..."""
    blob = crafted.splice(EMPTY_DICT, "x", crafted.object_array())
    read = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())['x'][0])"
    assert subprocess.run([sys.executable, "-c", read], input=blob, capture_output=True).returncode == -11  # SIGSEGV


def test_a_torchscript_archive_runs_its_code_under_torch_load(tmp_path):
    """The TorchScript construct is real: torch.load(weights_only=False) hands it to torch.jit.load, whose
    `__setstate__` writes the marker."""
    marker, archive = tmp_path / "marker", tmp_path / "model_states.pt"
    crafted.torchscript_archive(archive, marker)
    load = f"import torch; torch.load({str(archive)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", load], cwd=REPO, check=True, capture_output=True)
    assert marker.read_bytes() == b"AAAA"


@pytest.mark.parametrize("construct", list(crafted.payloads(REPO / "never")))
def test_each_construct_is_refused_by_name_and_nothing_runs(construct, tmp_path, base_file, registered_extension):
    payload, named = crafted.payloads(tmp_path / "marker")[construct]
    crafted.carry(base_file, "x", payload, tmp_path / "case.pt")
    with pytest.raises(safe_pickle.UnsafePickle, match="refused") as err:
        safe_pickle.load(tmp_path / "case.pt")
    assert named in str(err.value) and str(tmp_path / "case.pt") in str(err.value)
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("construct", list(crafted.files(REPO / "never")))
def test_each_crafted_file_is_refused_by_name_and_nothing_runs(construct, tmp_path, base_file):
    rewrite, named = crafted.files(tmp_path / "marker")[construct]
    rewrite(base_file)
    for trust in (False, True) if "TorchScript" in construct else (False,):
        with pytest.raises(safe_pickle.UnsafePickle, match=named):
            safe_pickle.load(base_file, trust=trust)
    assert not (tmp_path / "marker").exists()


def test_every_module_the_allowed_globals_name_gets_a_dotted_name_payload():
    """STACK_GLOBAL walks a dotted name attribute-wise: each module with an allowed global is tried for a path out."""
    modules = {name.rsplit(".", 1)[0] for _, name in safe_pickle.checkpoint_globals()}
    assert modules - {"numpy.dtypes"} <= set(crafted.ALLOWED_MODULES)


def numpy_values() -> dict:
    return {"array": np.arange(6, dtype=np.float32).reshape(2, 3), "be": np.array([1, 2], dtype=">u4")}


DATA = [
    {"a": [1, 2.5, None, True, False, "é", b"\x00\xff", bytearray(b"xy")], "b": (1, (2, (3,))), 7: -(2**70)},
    OrderedDict([("k", {1, 2}), ("c", complex(1, -2)), ("e", ((), [], {}, ""))]),
    {"ns": argparse.Namespace(lr=1e-3, name="run"), "numpy": numpy_values(), "rng": folder.rng_state()},
]


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("value", DATA)
def test_data_loads_as_torchs_weights_only_loader_loads_it(value, legacy, tmp_path):
    path = tmp_path / "data.pt"
    torch.save(value, path, _use_new_zipfile_serialization=not legacy)
    with torch.serialization.safe_globals(safe_pickle.checkpoint_globals()):
        theirs = torch.load(path, weights_only=True)
    ours = safe_pickle.load(path)
    assert repr(ours) == repr(theirs) and type(ours) is type(theirs)


def test_torch_files_load_as_torch_loads_them(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    value = {
        "view": base[2:8].view(2, 3),
        "base": base,
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "param": torch.nn.Parameter(torch.zeros(2)),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(6).reshape(2, 3).t(),
        "meta": OrderedDict(size=torch.Size([2, 3]), dtype=torch.float16, device=torch.device("cpu")),
    }
    for legacy in (False, True):
        path = tmp_path / f"legacy{legacy}.pt"
        torch.save(value, path, _use_new_zipfile_serialization=not legacy)
        ours, theirs = safe_pickle.load(path), torch.load(path, weights_only=True)
        assert ours.keys() == theirs.keys() and ours["meta"] == theirs["meta"]
        for key in ("view", "base", "bf16", "param", "empty", "strided"):
            assert type(ours[key]) is type(theirs[key]) and torch.equal(ours[key], theirs[key])
            assert ours[key].stride() == theirs[key].stride()
        assert ours["view"].untyped_storage().data_ptr() == ours["base"].untyped_storage().data_ptr()


def test_a_large_state_dict_stays_within_the_scans_budget(tmp_path):
    """The hashing budget is linear in the file: 5,000 tensors under long names, nested as an optimizer's state."""
    names = {f"base_model.model.layers.{i}.self_attn.q_proj.lora_A.weight": torch.zeros(1) for i in range(5_000)}
    state = {"module": names, "optimizer": {"state": {i: {"exp_avg": torch.zeros(1)} for i in range(2_000)}}}
    torch.save(state, tmp_path / "big.pt")
    assert len(safe_pickle.load(tmp_path / "big.pt")["module"]) == 5_000


def test_a_tensor_only_over_its_own_storage_and_within_it(tmp_path, base_file):
    original = crafted.pickle_of(base_file)[1]
    bigger = original.replace(b"K\x04t", b"K\x05t")  # the storage's numel, 4 -> 5 (the record holds 16 bytes)
    assert bigger != original
    crafted.rewrite_torch_file(base_file, tmp_path / "b.pt", bigger)
    with pytest.raises(safe_pickle.UnsafePickle, match="declared as 20 bytes; the file holds 16"):
        safe_pickle.load(tmp_path / "b.pt")
    past = original.replace(b"K\x04\x85", b"K\x09\x85")  # the tensor's size, (4,) -> (9,), over 4 floats
    assert past != original
    crafted.rewrite_torch_file(base_file, tmp_path / "c.pt", past)
    with pytest.raises(ValueError, match=r"c\.pt: cannot be read"):
        safe_pickle.load(tmp_path / "c.pt")


def test_tensors_that_read_one_element_twice_or_past_their_storage_are_refused(tmp_path):
    storage = torch.arange(16.0)
    for tensor, problem in (
        (storage[:1].expand(8, 4096), "zero or overlapping strides"),
        (storage.as_strided((4, 4), (2, 1)), "zero or overlapping strides"),
        (storage.as_strided((4, 4), (1, 1)), "zero or overlapping strides"),
        (storage.as_strided((2, 3), (1, 2)), None),  # transposed: no element twice
        (storage.as_strided((8, 2), (2, 1), 0), None),
    ):
        torch.save({"t": tensor}, tmp_path / "t.pt")
        if problem is None:
            assert torch.equal(safe_pickle.load(tmp_path / "t.pt")["t"], tensor)
        else:
            with pytest.raises(safe_pickle.UnsafePickle, match=problem):
                safe_pickle.load(tmp_path / "t.pt")


def test_nesting_that_would_crash_cpython_and_cycles_are_refused(tmp_path, base_file):
    lists = OP["EMPTY_LIST"] * (pickle_scan.MAX_DEPTH + 2) + OP["APPEND"] * (pickle_scan.MAX_DEPTH + 1)
    cycle = OP["EMPTY_LIST"] + OP["BINPUT"] + b"\xf0" + OP["BINGET"] + b"\xf0" + OP["APPEND"]
    for payload, problem in ((lists, "nested deeper"), (cycle, "contains itself")):
        crafted.carry(base_file, "x", payload, tmp_path / "case.pt")
        with pytest.raises(safe_pickle.UnsafePickle, match=problem):
            safe_pickle.load(tmp_path / "case.pt")
    deep: list = []  # a list filled after it was nested: the scan sees its depth late, the walk of the value does not
    for _ in range(pickle_scan.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper"):
        safe_pickle.check_value({"x": deep})


def test_numpy_arrays_of_numeric_dtypes_only(tmp_path, base_file):
    dtype = crafted.numpy_dtype("u4", ("<", -1, -1, 0))
    array = crafted.numpy_array(dtype, 2, b"\x01\x00\x00\x00\x02\x00\x00\x00")
    crafted.carry(base_file, "x", array, tmp_path / "ok.pt")
    assert safe_pickle.load(tmp_path / "ok.pt")["x"].tolist() == [1, 2]
    crafted.carry(base_file, "x", crafted.numpy_array(dtype, 3, b"\x00" * 4), tmp_path / "short.pt")
    with pytest.raises(ValueError, match="cannot be read"):  # numpy: buffer size does not match array size
        safe_pickle.load(tmp_path / "short.pt")
    for spec in ("O8", "V8", "U4", "M8[s]", "(2,)u4", "u4,u4"):
        crafted.carry(base_file, "x", crafted.numpy_array(crafted.numpy_dtype(spec), 1, b"A" * 8), tmp_path / "d.pt")
        with pytest.raises(safe_pickle.UnsafePickle, match="numpy dtype"):
            safe_pickle.load(tmp_path / "d.pt")


def test_legacy_storages_larger_than_the_file_and_tar_files_are_refused(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"t": torch.zeros(4)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    huge = data.replace(b"K\x04N", b"J\x00\x00\x00\x40N", 1)  # the storage's numel, 4 -> 2**30
    assert huge != data
    path.write_bytes(huge)
    with pytest.raises(safe_pickle.UnsafePickle, match="storages larger than the file"):
        safe_pickle.load(path)
    with tarfile.open(tmp_path / "old.pt", "w") as archive:
        archive.add(tmp_path / "legacy.pt", arcname="storages")
    with pytest.raises(safe_pickle.UnsafePickle, match="tar format"):
        safe_pickle.load(tmp_path / "old.pt")


def test_a_legacy_storage_left_unfilled_is_refused(tmp_path):
    """torch's legacy format fills the storages its last small pickle lists; one left out would keep whatever memory
    it was given (torch's loader hands it back as it is)."""
    path = tmp_path / "legacy.pt"
    torch.save({"t": torch.arange(4.0)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    stream = io.BytesIO(data)
    for _ in range(4):  # magic number, protocol, system info, the value: read opcode by opcode, never unpickled
        list(pickletools.genops(stream))
    keys_at = stream.tell()
    list(pickletools.genops(stream))
    path.write_bytes(data[:keys_at] + pickle.dumps([], protocol=2) + data[stream.tell() :])
    with pytest.raises(safe_pickle.UnsafePickle, match="a storage whose bytes the file does not hold"):
        safe_pickle.load(path)


def test_the_small_pickles_of_the_legacy_format_go_through_the_loader_too(tmp_path):
    """torch's legacy format starts with three small pickles (magic number, protocol, system info), which torch's
    weights-only loader reads too."""
    path, marker = tmp_path / "legacy.pt", tmp_path / "executed"
    torch.save({"t": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    stream = io.BytesIO(data)
    list(pickletools.genops(stream))  # the magic number's pickle, read opcode by opcode
    magic = OP["LONG1"] + b"\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
    command = crafted.system(marker, crafted.global_("posix", "system")) + OP["POP"]
    path.write_bytes(OP["PROTO"] + b"\x02" + command + magic + OP["STOP"] + data[stream.tell() :])
    with pytest.raises(safe_pickle.UnsafePickle, match="GLOBAL posix.system"):
        safe_pickle.load(path)
    assert not marker.exists()


def test_records_named_twice_and_compressed_storages_are_refused(tmp_path, base_file):
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(base_file, "a") as archive:
        archive.writestr(archive.infolist()[0].filename, b"")
    with pytest.raises(safe_pickle.UnsafePickle, match="stored twice"):
        safe_pickle.load(base_file)
    torch.save({"t": torch.arange(4.0)}, tmp_path / "t.pt")
    with zipfile.ZipFile(tmp_path / "t.pt") as source:
        entries = [(info.filename, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(tmp_path / "z.pt", "w", zipfile.ZIP_DEFLATED) as out:
        for name, data in entries:
            out.writestr(name, data)
    with pytest.raises(safe_pickle.UnsafePickle, match="storage record data/0 is compressed"):
        safe_pickle.load(tmp_path / "z.pt")


def test_truncated_files_are_unreadable_not_crashes(tmp_path, base_file):
    data = base_file.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 10):
        base_file.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cannot be read|refused"):
            safe_pickle.load(base_file)


def test_rng_state_is_checked_against_its_schema(tmp_path):
    path = tmp_path / "rng.pt"
    torch.save(folder.rng_state(), path)
    folder.set_rng_state(folder.read_rng_state(path))
    original = crafted.pickle_of(path)[1]
    gaussian = OP["BINFLOAT"] + b"\x00" * 8
    forged = crafted.tuple_(text("MT19937"), crafted.object_array(), crafted.small(0), crafted.small(0), gaussian)
    crafted.rewrite_torch_file(path, tmp_path / "object.pt", crafted.splice(original, "numpy", forged))
    with pytest.raises(safe_pickle.UnsafePickle, match="numpy dtype 'O8'"):
        folder.read_rng_state(tmp_path / "object.pt")
    state = folder.rng_state()
    for broken, problem in (
        ({**state, "torch": state["torch"][:100]}, "torch: expected a contiguous uint8 tensor"),
        ({**state, "torch": state["torch"].repeat(2)[::2]}, "torch: expected a contiguous uint8 tensor"),
        ({**state, "numpy": (state["numpy"][0], state["numpy"][1][:10], *state["numpy"][2:])}, "uint32 array of 624"),
        ({**state, "python": (3, (2**40,) * 625, None)}, "624 uint32 words"),
        ({**state, "extra": 1}, "expected a dict of python"),
        ({**state, "cuda": [torch.zeros(17, dtype=torch.uint8)]}, "contiguous uint8 tensors of 16"),
    ):
        torch.save(broken, path)
        with pytest.raises(ValueError, match=problem):
            folder.read_rng_state(path)


def test_a_loss_scaler_becomes_deepspeeds_own_with_checked_fields(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    settings = {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2, "consecutive_hysteresis": False}
    live = DynamicLossScaler(init_scale=2.0**16, **settings)
    path = tmp_path / "optim.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": live}}, path)
    stand_in = safe_pickle.load(path)["optimizer_state_dict"]["loss_scaler"]
    assert isinstance(stand_in, safe_pickle.StandIn) and stand_in.cur_scale == 2.0**16
    revived = engine_loads.RestrictedLoads(None).load(str(path))["optimizer_state_dict"]["loss_scaler"]
    assert type(revived) is DynamicLossScaler and revived.__dict__ == live.__dict__
    live.cur_scale = "1e9"
    torch.save({"optimizer_state_dict": {"loss_scaler": live}}, path)
    with pytest.raises(safe_pickle.UnsafePickle, match="with field cur_scale='1e9'"):
        engine_loads.RestrictedLoads(None).load(str(path))
    live.cur_scale = [1.0]
    torch.save({"optimizer_state_dict": {"loss_scaler": live}}, path)
    with pytest.raises(safe_pickle.UnsafePickle, match="DynamicLossScaler with a state other than plain values"):
        safe_pickle.load(path)


def test_trust_pickles_hands_the_file_to_torch_load_without_weights_only(tmp_path, base_file):
    payload, _ = crafted.payloads(tmp_path / "marker")["GLOBAL posix.system"]
    crafted.carry(base_file, "x", payload, tmp_path / "x.pt")
    with pytest.raises(safe_pickle.UnsafePickle):
        safe_pickle.load(tmp_path / "x.pt")
    assert not (tmp_path / "marker").exists()
    assert safe_pickle.load(tmp_path / "x.pt", trust=True)["x"] == 0
    assert (tmp_path / "marker").exists()


def test_the_loader_never_uses_pythons_unpickler(tmp_path, base_file, monkeypatch):
    """torch's weights-only loader has an unpickler of its own: Python's is never asked to read a checkpoint."""

    def refuse(*args, **kwargs):
        raise AssertionError("Python's unpickler used")

    shutil.copy(base_file, tmp_path / "copy.pt")
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    assert torch.equal(safe_pickle.load(tmp_path / "copy.pt")["t"], torch.arange(4.0))


def test_tensor_attributes_load_only_as_plain_values_under_names_none_of_torchs(tmp_path):
    """ZeRO-3 saves its flat fp32 groups with their `ds_id`; an attribute that shadows a tensor method is refused."""
    tagged = torch.zeros(3)
    tagged.ds_id = "22_50"
    torch.save({"t": tagged}, tmp_path / "ok.pt")
    assert safe_pickle.load(tmp_path / "ok.pt")["t"].ds_id == "22_50"
    for name, value, problem in (
        ("clone", 5, "attributes other than plain values"),
        ("ds_id", [1], "attributes other than plain values"),
        ("__class__", "x", "__class__ must be set to a class"),  # torch's own setattr fails
    ):
        shadowing = torch.zeros(3)
        shadowing.__dict__[name] = value
        torch.save({"t": shadowing}, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match=problem):
            safe_pickle.load(tmp_path / "bad.pt")


def test_a_call_of_a_storage_is_refused_before_torch_prints_it(tmp_path):
    """torch's loader refuses a REDUCE of a value it was not given as a global by printing that value: the repr of
    a storage is element by element (a 6 MB one hung the fuzzer, seed 7 case 1296)."""
    torch.save({"t": torch.zeros(1 << 20)}, tmp_path / "big.pt")
    storage = crafted.tuple_(text("storage"), crafted.global_("torch", "FloatStorage"), text("0"), text("cpu"))
    pid = storage[:-1] + OP["BININT"] + (1 << 20).to_bytes(4, "little") + OP["TUPLE"] + OP["BINPERSID"]
    crafted.carry(tmp_path / "big.pt", "x", pid + OP["EMPTY_TUPLE"] + OP["REDUCE"], tmp_path / "case.pt")
    with pytest.raises(safe_pickle.UnsafePickle, match="REDUCE of a value made by opcode BINPERSID"):
        safe_pickle.load(tmp_path / "case.pt")
