"""A self-contained GGUF reader (numpy only): metadata, tensor infos, dequantization.

GGUF is llama.cpp's file format: a header, typed metadata, tensor infos, then aligned tensor
data. Dimensions are listed fastest-first ([ne0, ne1] is torch shape (ne1, ne0)). Block
types quantize the fastest dimension in blocks of 32: Q4_1 stores a float16 scale d and
minimum m plus 32 4-bit codes q (x = d*q + m), Q8_0 stores d and 32 int8 codes (x = d*q).
The engine's machines do not have the `gguf` package; tests/test_smollm2.py checks this
reader against it as an independent oracle.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class GGUFError(ValueError):
    """A GGUF file this reader cannot read (corrupt, or a feature it does not support)."""


GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types (gguf.GGUFValueType): struct format of each scalar type.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                  6: np.float32, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type: `block` values are stored in `nbytes` bytes."""
    name: str
    block: int
    nbytes: int


# The ggml types this reader dequantizes, by their ggml type id.
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 2 + 16),
    3: GGMLType("Q4_1", 32, 2 + 2 + 16),
    8: GGMLType("Q8_0", 32, 2 + 32),
    30: GGMLType("BF16", 1, 2),
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]   # torch order (slowest dimension first)
    type_id: int
    offset: int              # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        t = GGML_TYPES.get(self.type_id)
        return t.name if t else f"ggml type {self.type_id}"


class GGUFFile:
    """A GGUF v2/v3 file, memory-mapped: `metadata` (key -> value) and `tensors` (name -> info).

    Arrays of numbers come back as numpy arrays, arrays of strings as lists of str.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self.data[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self.data[:4])!r}, "
                            f"expected {GGUF_MAGIC!r})")
        self._pos = 4
        self.version = self._scalar(4)
        if self.version not in (2, 3):
            hint = " (a big-endian file?)" if self.version > 0xFFFF else ""
            raise GGUFError(f"{self.path}: GGUF version {self.version}{hint} is not supported; "
                            "this reader handles versions 2 and 3")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            dims = [self._scalar(10) for _ in range(n_dims)]
            infos.append((name, tuple(reversed(dims)), self._scalar(4), self._scalar(10)))
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment={self.alignment} is not a power of 2")
        self.data_start = -(-self._pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, type_id, rel in infos:
            t = GGUFTensor(name, shape, type_id, self.data_start + rel)
            if rel % self.alignment:
                raise GGUFError(f"{self.path}: tensor {name} at offset {rel} is not aligned to "
                                f"{self.alignment} bytes")
            if type_id in GGML_TYPES and t.offset + self._nbytes(t) > len(self.data):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file "
                                "(truncated download?)")
            self.tensors[name] = t

    # -- header parsing: a cursor over the mapped bytes --

    def _take(self, n: int) -> np.ndarray:
        if self._pos + n > len(self.data):
            raise GGUFError(f"{self.path}: unexpected end of file in the header at byte "
                            f"{self._pos} (truncated file?)")
        chunk = self.data[self._pos:self._pos + n]
        self._pos += n
        return chunk

    def _scalar(self, vtype: int):
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)).tobytes())[0]

    def _string(self) -> str:
        return self._take(self._scalar(10)).tobytes().decode("utf-8")

    def _value(self, vtype: int):
        if vtype in _SCALAR_FORMATS:
            return self._scalar(vtype)
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._scalar(4), self._scalar(10)
            if etype in _NUMPY_SCALARS:
                dt = np.dtype(_NUMPY_SCALARS[etype]).newbyteorder("<")
                return np.frombuffer(self._take(count * dt.itemsize).tobytes(), dtype=dt)
            return [self._value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self._pos}")

    # -- tensors --

    @staticmethod
    def _nbytes(t: GGUFTensor) -> int:
        gt = GGML_TYPES[t.type_id]
        n = int(np.prod(t.shape, dtype=np.int64))
        return n // gt.block * gt.nbytes

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` (uint8, a view into the mapped file)."""
        t = self.tensors[name]
        if t.type_id not in GGML_TYPES:
            supported = ", ".join(g.name for g in GGML_TYPES.values())
            raise GGUFError(f"{self.path}: tensor {name} has {t.type_name}, which this reader "
                            f"cannot dequantize (supported: {supported})")
        return self.data[t.offset:t.offset + self._nbytes(t)]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, in torch shape order."""
        t = self.tensors[name]
        raw = self.raw(name)
        return dequantize(raw, t.type_id, t.shape)


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of `shape` from the bytes `raw` of a tensor stored as ggml type `type_id`.

    Block types split the last (fastest) dimension into blocks of 32 values; each block is a
    float16 scale d (Q4_1 adds a float16 minimum m) followed by the codes:
        Q8_0: 32 int8 codes,                   x = d * q
        Q4_0: 16 bytes, low nibbles are values 0..15 of the block and high nibbles 16..31,
                                               x = d * (q - 8)
        Q4_1: same nibbles as Q4_0,            x = d * q + m
    """
    gt = GGML_TYPES.get(type_id)
    if gt is None:
        supported = ", ".join(f"{g.name} ({i})" for i, g in GGML_TYPES.items())
        raise GGUFError(f"ggml type {type_id} is not supported (supported: {supported})")
    if shape and shape[-1] % gt.block:
        raise GGUFError(f"{gt.name}: the last dimension {shape[-1]} is not a multiple of the "
                        f"block size {gt.block}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if gt.name == "F32":
        out = raw.view("<f4").astype(np.float32)
    elif gt.name == "F16":
        out = raw.view("<f2").astype(np.float32)
    elif gt.name == "BF16":
        out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        blocks = raw.reshape(-1, gt.nbytes)
        d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
        if gt.name == "Q8_0":
            out = d * blocks[:, 2:].view(np.int8).astype(np.float32)
        else:
            qs = blocks[:, -16:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
            if gt.name == "Q4_0":
                out = d * (q - 8.0)
            else:  # Q4_1
                m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
                out = d * q + m
    return out.reshape(shape)


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q_proj / k_proj ([n_heads * head_dim, hidden]).

    convert_hf_to_gguf.py stores w.reshape(n_heads, 2, head_dim // 2, ...).swapaxes(1, 2):
    within each head, rows (i, i + head_dim/2) -- a Hugging Face rotary pair -- become
    neighbours (2i, 2i + 1). The inverse reads the rows as (head_dim // 2, 2) and swaps back.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot unpermute {rows} rows into {n_heads} heads of even size")
    return np.ascontiguousarray(
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
