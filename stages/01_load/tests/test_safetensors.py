"""Stage 01: the hand-written safetensors reader (safetensors.py).

Every tensor is compared bit for bit with the `safetensors` library reading the same file,
written by the library itself. Zero-copy is checked on the addresses: a tensor must point
into the memory-mapped file, not into a copy. Each malformed file has its own test, and the
error must be a CheckpointError that names the file (and the tensor, where there is one).
"""
from __future__ import annotations

import gc
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file as library_load_file
from safetensors.torch import save_file

from course import parts
from course.testing import checks


def st():
    return parts.load("01", "safetensors")


# --- files written by the safetensors library --------------------------------------------

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2]
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
SHAPES = [(3, 5), (7,), (2, 3, 4, 5), (1,), (), (0,), (4, 0, 3), (129, 3)]


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in INT_DTYPES:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def mixed_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype the reader must know, in odd shapes, scalars and empty tensors."""
    gen = checks.generator(seed=seed)
    out = {}
    for i, dtype in enumerate(FLOAT_DTYPES + INT_DTYPES + [torch.bool]):
        for j, shape in enumerate(SHAPES):
            if (i + j) % 3 == 0 or shape in ((), (0,)):  # every dtype gets a scalar and an empty
                name = f"layer.{i}.{str(dtype).removeprefix('torch.')}.{j}"
                out[name] = random_tensor(dtype, shape, gen)
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (bit-exact comparison, NaN and float8 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    assert isinstance(got, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(got)}"
    assert got.dtype == expected.dtype, (
        f"{name}: dtype {got.dtype}, expected {expected.dtype} (check dtype_table)")
    assert tuple(got.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(got.shape)}, expected {tuple(expected.shape)} "
        "(reshape to the header's shape; a scalar has shape [] -> ())")
    checks.assert_equal(raw_bytes(got), raw_bytes(expected), what=f"{name} bytes",
                        hint="wrong offset: data_offsets count from the start of the data "
                             "buffer, which begins at 8 + N, not at 0 or 8")


def test_matches_the_safetensors_library(tmp_path, seed):
    tensors = mixed_tensors(seed)
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "stage 01"})
    expected = library_load_file(str(path))
    got = st().load_file(path)
    assert sorted(got) == sorted(expected), (
        f"names differ: missing {sorted(set(expected) - set(got))}, "
        f"unexpected {sorted(set(got) - set(expected))}")
    for name, t in expected.items():
        assert_same_tensor(got[name], t, name)


def test_names_info_metadata(tmp_path, seed):
    tensors = mixed_tensors(seed)
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "stage 01"})
    with safe_open(str(path), framework="pt") as lib, st().SafetensorsFile(path) as f:
        assert sorted(f.names()) == sorted(lib.keys())
        assert f.metadata == lib.metadata(), "metadata is the header's __metadata__ object"
        for name in lib.keys():
            assert name in f
            t = lib.get_tensor(name)
            dtype, shape = f.info(name)
            assert tuple(shape) == tuple(t.shape), f"{name}: info shape {shape}"
            assert isinstance(dtype, str) and st().dtype_table()[dtype] == t.dtype, (
                f"{name}: info dtype {dtype!r}, the tensor is {t.dtype}")
        assert "not.a.tensor" not in f


def test_no_tensors_at_all(tmp_path):
    path = tmp_path / "empty.safetensors"
    save_file({}, str(path), metadata={"format": "pt"})
    with st().SafetensorsFile(path) as f:
        assert f.names() == []
        assert f.metadata == {"format": "pt"}
    assert st().load_file(path) == {}


# --- zero-copy ---------------------------------------------------------------------------

def header_offsets(path: Path) -> tuple[dict, int]:
    """The header and the data start, read here independently of the code under test."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), 8 + n


def mapping_of(address: int) -> str | None:
    """The file behind the memory mapping that contains `address` (Linux), else None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else ""
    return None


def test_tensors_are_views_of_the_mapped_file(tmp_path, seed):
    gen = checks.generator(seed=seed)
    tensors = {"a": checks.randn((64, 33), torch.bfloat16, gen=gen),
               "b": checks.randn((1000,), torch.float32, gen=gen),
               "c": checks.randn((5, 7), torch.float16, gen=gen)}
    path = tmp_path / "views.safetensors"
    save_file(tensors, str(path))
    header, data_start = header_offsets(path)
    with st().SafetensorsFile(path) as f:
        got = {name: f.tensor(name) for name in tensors}
        again = f.tensor("b")
    assert again.data_ptr() == got["b"].data_ptr(), (
        "reading the same tensor twice gave two buffers: tensor() must return a view of the "
        "memory-mapped file (torch.frombuffer), not read or copy the bytes")
    base = got["a"].data_ptr() - (data_start + header["a"]["data_offsets"][0])
    for name, t in got.items():
        where = t.data_ptr() - base
        assert where == data_start + header[name]["data_offsets"][0], (
            f"{name} is not where the file keeps it: it lies {where} bytes after 'a''s mapping "
            f"base, the file has it at byte {data_start + header[name]['data_offsets'][0]}. "
            "Each tensor must be a view into the one mapping of the file (no copies)")
    if Path("/proc/self/maps").exists():
        mapped = mapping_of(got["b"].data_ptr())
        assert mapped is not None and Path(mapped.removesuffix(" (deleted)")) == path.resolve(), (
            f"tensor b's memory belongs to {mapped or 'anonymous memory'!r}, not to a mapping "
            f"of {path}: map the file with mmap and use torch.frombuffer on the mapping")
    for name, t in tensors.items():
        assert_same_tensor(got[name], t, name)


def test_tensors_outlive_the_file_object(tmp_path, seed):
    gen = checks.generator(seed=seed)
    tensors = {"w": checks.randn((257, 3), torch.bfloat16, gen=gen),
               "x": checks.randn((9,), torch.float32, gen=gen)}
    path = tmp_path / "lifetime.safetensors"
    save_file(tensors, str(path))
    with st().SafetensorsFile(path) as f:
        w = f.tensor("w")
    del f
    loaded = st().load_file(path)
    gc.collect()
    assert_same_tensor(w, tensors["w"], "w (after the file was closed)")
    assert_same_tensor(loaded["x"], tensors["x"], "x (from load_file)")


# --- malformed files ---------------------------------------------------------------------

def write_raw(path: Path, header: dict | bytes, data: bytes = b"", n: int | None = None) -> Path:
    """A file laid out by hand: u64 header length (n, if given, lies), header, data."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if n is None else n) + blob + data)
    return path


def expect_checkpoint_error(fn, path: Path, *names: str, hint: str) -> str:
    """Run fn; it must raise CheckpointError naming the file and each of `names`."""
    try:
        fn()
    except NotImplementedError:
        raise
    except st().CheckpointError as e:
        msg = str(e)
        assert path.name in msg, f"the error must name the file {path.name}; it says: {msg!r}"
        for name in names:
            assert name in msg, f"the error must name {name!r}; it says: {msg!r}"
        return msg
    except Exception as e:
        raise AssertionError(f"expected a CheckpointError naming {path.name} "
                             f"{' and '.join(names)}, got {type(e).__name__}: {e}. Likely "
                             f"cause: {hint}") from e
    raise AssertionError(f"{path.name} is malformed but was accepted. Likely cause: {hint}")


def opening(path):
    return lambda: st().SafetensorsFile(path)


def f32_entry(shape, begin, end, dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def test_empty_file(tmp_path):
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    expect_checkpoint_error(opening(path), path, hint="check len(buf) >= 8 before unpacking N")


def test_shorter_than_8_bytes(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    expect_checkpoint_error(opening(path), path, hint="check len(buf) >= 8 before unpacking N")


def test_header_length_past_end_of_file(tmp_path):
    # A valid header, but N claims 1000 bytes more than the file has: buf[8:8 + N] would
    # quietly stop at the end of the file and parse fine, so only an explicit check sees it.
    blob = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    path = write_raw(tmp_path / "longheader.safetensors", blob, n=len(blob) + 1000)
    expect_checkpoint_error(opening(path), path, hint="check 8 + N <= file size (slicing past "
                                                      "the end of a buffer does not fail)")


def test_truncated_inside_the_header(tmp_path, seed):
    path = tmp_path / "cut.safetensors"
    save_file({"w": checks.randn((16, 16), torch.float32, gen=checks.generator(seed=seed))},
              str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[:8 + n // 2])
    expect_checkpoint_error(opening(path), path, hint="check 8 + N <= file size")


def test_truncated_inside_the_data(tmp_path, seed):
    gen = checks.generator(seed=seed)
    path = tmp_path / "cutdata.safetensors"
    save_file({"a": checks.randn((8,), torch.float32, gen=gen),
               "z": checks.randn((64, 3), torch.float32, gen=gen)}, str(path))
    header, _ = header_offsets(path)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    last = max(entries, key=lambda k: entries[k]["data_offsets"][1])  # the one cut short
    path.write_bytes(path.read_bytes()[:-10])
    expect_checkpoint_error(opening(path), path, last,
                            hint="check end <= size of the data buffer (file size - 8 - N) "
                                 "for every tensor when the file is opened")


def test_header_not_json(tmp_path):
    path = write_raw(tmp_path / "notjson.safetensors", b'{"w": {"dtype": "F32", "sha', bytes(8))
    expect_checkpoint_error(opening(path), path,
                            hint="json.loads raises ValueError: catch it and raise "
                                 "CheckpointError")


def test_header_not_utf8(tmp_path):
    path = write_raw(tmp_path / "binary.safetensors", b"\xff\xfe\x00\x81garbage", bytes(8))
    expect_checkpoint_error(opening(path), path,
                            hint="bytes that are not UTF-8 raise UnicodeDecodeError in "
                                 "json.loads: catch it too")


def test_header_not_an_object(tmp_path):
    path = write_raw(tmp_path / "list.safetensors", [1, 2, 3], bytes(8))  # type: ignore[arg-type]
    expect_checkpoint_error(opening(path), path,
                            hint="valid JSON is not enough: the header must be a dict")


def test_entry_not_an_object(tmp_path):
    path = write_raw(tmp_path / "entry.safetensors",
                     {"good": f32_entry((2,), 0, 8), "bad.entry": [0, 8]}, bytes(8))
    expect_checkpoint_error(opening(path), path, "bad.entry",
                            hint="each entry must be an object with dtype, shape, data_offsets")


def test_data_offsets_past_end_of_data(tmp_path):
    path = write_raw(tmp_path / "offsets.safetensors",
                     {"ok": f32_entry((2,), 0, 8), "too.far": f32_entry((100,), 8, 408)},
                     bytes(16))
    expect_checkpoint_error(opening(path), path, "too.far",
                            hint="check 0 <= begin <= end <= size of the data buffer")


def test_data_offsets_reversed(tmp_path):
    path = write_raw(tmp_path / "reversed.safetensors", {"backwards": f32_entry((0,), 8, 4)},
                     bytes(16))
    expect_checkpoint_error(opening(path), path, "backwards", hint="check begin <= end")


def test_overlapping_tensors(tmp_path):
    path = write_raw(tmp_path / "overlap.safetensors",
                     {"first": f32_entry((4,), 0, 16), "second": f32_entry((4,), 8, 24)},
                     bytes(24))
    msg = expect_checkpoint_error(opening(path), path, hint="sort by begin; each begin must "
                                                            "be >= the previous end")
    assert "first" in msg and "second" in msg, f"name both overlapping tensors: {msg!r}"


def test_unknown_dtype(tmp_path):
    path = write_raw(tmp_path / "dtype.safetensors", {"q4": f32_entry((2,), 0, 8, "Q4_0")},
                     bytes(8))
    expect_checkpoint_error(opening(path), path, "q4", "Q4_0",
                            hint="look the dtype up in dtype_table() and reject unknown names")


def test_shape_does_not_match_byte_count(tmp_path):
    path = write_raw(tmp_path / "bytes.safetensors", {"mat": f32_entry((3, 3), 0, 32)},
                     bytes(32))
    expect_checkpoint_error(opening(path), path, "mat",
                            hint="end - begin must be prod(shape) * itemsize (3*3*4 = 36)")


def test_shape_not_a_list_of_sizes(tmp_path):
    path = write_raw(tmp_path / "negshape.safetensors", {"neg": f32_entry((-2, -1), 0, 8)},
                     bytes(8))
    expect_checkpoint_error(opening(path), path, "neg",
                            hint="a shape is a list of integers >= 0 ((-2)*(-1) = 2 fits 8 "
                                 "bytes, but is no shape)")


def test_missing_tensor(tmp_path, seed):
    gen = checks.generator(seed=seed)
    path = tmp_path / "some.safetensors"
    save_file({f"model.layers.{i}.weight": checks.randn((3,), torch.float32, gen=gen)
               for i in range(3)}, str(path))
    with st().SafetensorsFile(path) as f:
        msg = expect_checkpoint_error(lambda: f.tensor("model.layers.9.weight"), path,
                                      "model.layers.9.weight", hint="look the name up")
        assert "model.layers.0.weight" in msg, (
            f"list a few of the names the file does hold, to help spot typos: {msg!r}")
        with pytest.raises(KeyError):
            f.info("model.layers.9.weight")
