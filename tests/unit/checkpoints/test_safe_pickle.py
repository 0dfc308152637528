"""The restricted loader (pipeline/checkpoints/safe_pickle.py): every payload of tests/helpers/crafted_pickles.py,
written from pickle's own opcode table, is live under Python's unpickler and refused by ours with its construct
named and nothing run; data that Python's pickler and torch.save write (every protocol, legacy and zip formats)
loads to what they load; and what no opcode filter can see (tensors over foreign storages, nesting that crashes
CPython's hash, object dtypes, RNG states of the wrong shape) is refused."""

from __future__ import annotations

import argparse
import copyreg
import io
import pickle
import pickletools
import subprocess
import sys
import tarfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from pipeline.checkpoints import engine_loads, folder, pickle_allowlist, safe_pickle
from pipeline.checkpoints.unpickler import MAX_DEPTH, Machine, Refused, brief
from tests.conftest import REPO
from tests.helpers import crafted_pickles as crafted
from tests.helpers.crafted_pickles import OP, text

EMPTY_DICT = OP["PROTO"] + b"\x02" + OP["EMPTY_DICT"] + OP["STOP"]


def machine_load(data: bytes) -> object:
    return Machine(io.BytesIO(data), pickle_allowlist.policy()).load()


@pytest.fixture
def registered_extension():
    """posix.system under crafted.EXT_CODE in copyreg's registry, as another library might have left it."""
    copyreg.add_extension("posix", "system", crafted.EXT_CODE)
    yield
    copyreg.remove_extension("posix", "system", crafted.EXT_CODE)


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


@pytest.mark.parametrize("construct", list(crafted.payloads(REPO / "never")))
def test_each_construct_is_refused_by_name_and_nothing_runs(construct, tmp_path, registered_extension):
    payload, named = crafted.payloads(tmp_path / "marker")[construct]
    with pytest.raises(Refused) as err:
        machine_load(crafted.splice(EMPTY_DICT, "x", payload))
    assert named in str(err.value)
    assert not (tmp_path / "marker").exists()


def test_every_module_the_allowlist_names_gets_a_dotted_name_payload():
    """STACK_GLOBAL walks a dotted name attribute-wise: each module with an allowed global is tried for a path out."""
    assert {module for module, _ in pickle_allowlist.policy().names} <= set(crafted.ALLOWED_MODULES)


def test_the_extension_registry_is_named_not_followed(registered_extension):
    payload, _ = crafted.payloads(REPO / "never")["EXT1 posix.system"]
    with pytest.raises(Refused, match=r"EXT1 extension code 240 \(posix.system in copyreg's registry\)"):
        machine_load(crafted.splice(EMPTY_DICT, "x", payload))


DATA = [
    {"a": [1, 2.5, None, True, False, "é", b"\x00\xff", bytearray(b"xy")], "b": (1, (2, (3,))), 7: -(2**70)},
    OrderedDict([("k", {1, 2}), ("f", frozenset({"x"})), ("c", complex(1, -2)), ("s", slice(1, None, 2))]),
    [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], dtype=">u4"), np.float64(1.5), np.uint32(7)],
    {"ns": argparse.Namespace(lr=1e-3, name="run"), "empty": ((), [], {}, "")},
]


@pytest.mark.parametrize("protocol", range(6))
@pytest.mark.parametrize("value", DATA)
def test_data_loads_as_pythons_unpickler_loads_it(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    ours, theirs = machine_load(data), pickle.loads(data)
    assert repr(ours) == repr(theirs) and type(ours) is type(theirs)


def test_shared_references_stay_shared():
    shared = [1, 2]
    ours = machine_load(pickle.dumps({"a": shared, "b": shared}, protocol=2))
    assert ours["a"] is ours["b"]


def test_nesting_that_would_crash_cpython_is_refused():
    """A dict keyed by 100,000 nested tuples: hashing it overflows the C stack (a segfault under pickle.loads)."""
    deep = OP["EMPTY_TUPLE"] + OP["TUPLE1"] * 100_000
    with pytest.raises(Refused, match="nested deeper"):
        machine_load(OP["PROTO"] + b"\x02" + OP["EMPTY_DICT"] + deep + OP["NONE"] + OP["SETITEM"] + OP["STOP"])
    lists = OP["EMPTY_LIST"] * (MAX_DEPTH + 2) + OP["APPEND"] * (MAX_DEPTH + 1)
    with pytest.raises(Refused, match="nested deeper"):
        machine_load(OP["PROTO"] + b"\x02" + lists + OP["STOP"])
    cycle = OP["EMPTY_LIST"] + OP["BINPUT"] + b"\x00" + OP["BINGET"] + b"\x00" + OP["APPEND"] + OP["STOP"]
    with pytest.raises(Refused, match="contains itself"):
        machine_load(OP["PROTO"] + b"\x02" + cycle)


def test_a_global_is_never_a_value():
    rebuild = crafted.global_("torch._utils", "_rebuild_tensor_v2")
    with pytest.raises(Refused, match="torch._utils._rebuild_tensor_v2 used as a value"):
        machine_load(crafted.splice(EMPTY_DICT, "f", rebuild))


def test_items_go_only_into_plain_containers():
    size = crafted.call(crafted.global_("torch", "Size"), OP["EMPTY_LIST"])
    with pytest.raises(Refused, match="APPEND on torch.Size"):
        machine_load(OP["PROTO"] + b"\x02" + size + OP["NONE"] + OP["APPEND"] + OP["STOP"])


def test_numpy_state_is_set_once_and_dtypes_stay_numeric():
    dtype = crafted.numpy_dtype("u4", ("<", -1, -1, 0))
    array = crafted.numpy_array(dtype, 2, b"\x01\x00\x00\x00\x02\x00\x00\x00")
    assert machine_load(array + OP["STOP"]).tolist() == [1, 2]
    one = crafted.tuple_(crafted.small(1))
    state = crafted.tuple_(crafted.small(1), one, dtype, OP["NEWFALSE"], crafted.raw(b"x" * 4))
    with pytest.raises(Refused, match="already built"):
        machine_load(array + state + OP["BUILD"] + OP["STOP"])
    structured = crafted.numpy_dtype("u4", ("<", 8, 4, 0))
    with pytest.raises(Refused, match="fields, a sub-array, a size or flags"):
        machine_load(structured + OP["STOP"])
    with pytest.raises(Refused, match="raw bytes are not"):
        machine_load(crafted.numpy_array(dtype, 3, b"\x00" * 4) + OP["STOP"])


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
        ours, theirs = safe_pickle.load(path), torch.load(path, weights_only=False)
        assert ours.keys() == theirs.keys() and ours["meta"] == theirs["meta"]
        for key in ("view", "base", "bf16", "param", "empty", "strided"):
            assert type(ours[key]) is type(theirs[key]) and torch.equal(ours[key], theirs[key])
            assert ours[key].stride() == theirs[key].stride()
        assert ours["view"].untyped_storage().data_ptr() == ours["base"].untyped_storage().data_ptr()


def tensor_file(tmp_path, value) -> tuple:
    path = tmp_path / "t.pt"
    torch.save(value, path)
    return path, crafted.pickle_of(path)[1]


def test_a_tensor_only_over_its_own_storage_and_within_it(tmp_path):
    path, original = tensor_file(tmp_path, {"t": torch.arange(4.0)})
    outside, _ = crafted.payloads(tmp_path / "m")["a persistent id naming a storage outside the file"]
    crafted.rewrite_torch_file(path, tmp_path / "a.pt", crafted.splice(original, "x", outside))
    with pytest.raises(safe_pickle.UnsafePickle, match="naming storage '999', which is not in the file"):
        safe_pickle.load(tmp_path / "a.pt")
    bigger = original.replace(b"K\x04t", b"K\x05t")  # the storage's numel, 4 -> 5 (the record holds 16 bytes)
    assert bigger != original
    crafted.rewrite_torch_file(path, tmp_path / "b.pt", bigger)
    with pytest.raises(safe_pickle.UnsafePickle, match="the file holds another size"):
        safe_pickle.load(tmp_path / "b.pt")
    past = original.replace(b"K\x04\x85", b"K\x09\x85")  # the tensor's size, (4,) -> (9,), over 4 floats
    assert past != original
    crafted.rewrite_torch_file(path, tmp_path / "c.pt", past)
    with pytest.raises(safe_pickle.UnsafePickle, match="reads past its storage"):
        safe_pickle.load(tmp_path / "c.pt")


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


def test_truncated_files_are_unreadable_not_crashes(tmp_path):
    path, _ = tensor_file(tmp_path, {"t": torch.arange(4.0)})
    data = path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cannot be read|refused"):
            safe_pickle.load(path)


def test_rng_state_is_checked_against_its_schema(tmp_path):
    path = tmp_path / "rng.pt"
    torch.save(folder.rng_state(), path)
    folder.set_rng_state(folder.read_rng_state(path))
    original = crafted.pickle_of(path)[1]
    forged = crafted.tuple_(text("MT19937"), crafted.object_array(), crafted.small(0), crafted.small(0), OP["BINFLOAT"])
    forged = forged[:-1] + OP["BINFLOAT"] + b"\x00" * 8 + OP["TUPLE"]
    crafted.rewrite_torch_file(path, tmp_path / "object.pt", crafted.splice(original, "numpy", forged))
    with pytest.raises(safe_pickle.UnsafePickle, match="an object dtype"):
        folder.read_rng_state(tmp_path / "object.pt")
    state = folder.rng_state()
    for broken, problem in (
        ({**state, "torch": state["torch"][:100]}, "torch: expected a contiguous uint8 tensor"),
        ({**state, "torch": state["torch"].repeat(2)[::2]}, "torch: expected a contiguous uint8 tensor"),
        ({**state, "torch": state["torch"][:1].expand(state["torch"].numel())}, "torch: expected a contiguous"),
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
    revived = engine_loads.RestrictedLoads(None).load(str(path))["optimizer_state_dict"]["loss_scaler"]
    assert type(revived) is DynamicLossScaler and revived.__dict__ == live.__dict__
    live.cur_scale = "1e9"
    torch.save({"optimizer_state_dict": {"loss_scaler": live}}, path)
    with pytest.raises(safe_pickle.UnsafePickle, match="with field cur_scale='1e9'"):
        engine_loads.RestrictedLoads(None).load(str(path))


def test_trust_pickles_hands_the_file_to_pythons_unpickler(tmp_path):
    path, original = tensor_file(tmp_path, {"t": torch.arange(4.0)})
    payload, _ = crafted.payloads(tmp_path / "marker")["GLOBAL posix.system"]
    crafted.rewrite_torch_file(path, tmp_path / "x.pt", crafted.splice(original, "x", payload))
    with pytest.raises(safe_pickle.UnsafePickle):
        safe_pickle.load(tmp_path / "x.pt")
    assert not (tmp_path / "marker").exists()
    assert safe_pickle.load(tmp_path / "x.pt", trust=True)["x"] == 0
    assert (tmp_path / "marker").exists()


def test_a_legacy_storage_left_unfilled_is_refused(tmp_path):
    """torch's legacy format fills the storages its last small pickle lists; one left out would keep whatever memory
    it was given."""
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
    """torch's legacy format starts with three small pickles (magic number, protocol, system info) that torch reads
    with the pickle module's `load`; the first pass handed them to Python's pickle.load, which ran this one."""
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


def test_a_refusal_describes_the_value_without_its_str_or_repr():
    """A crafted persistent id can hold a large tensor (its str took 20 s in the fuzzer: a hang) or an object whose
    repr runs code: the message names types and plain scalars only."""

    class Hostile:
        def __repr__(self):
            raise AssertionError("repr called")

        __str__ = __repr__

    described = brief(("storage", torch.zeros(10_000_000), Hostile(), 7, "x" * 100, list(range(20))))
    assert described.startswith("('storage', Tensor, Hostile, 7, 'xxx")
    assert len(described) < 200
