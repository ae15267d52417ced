"""Reading safetensors files with plain reads (models/loader.py): every tensor equal to what
the safetensors library reads, in every dtype checkpoints hold, scalars and empty tensors
included; a truncated file and an unknown dtype are clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import SAFETENSORS_DTYPES, read_safetensors


def test_every_tensor_as_the_library_reads_it(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"t.{str(dtype)[6:]}": (torch.randn(5, 7, generator=gen) * 10).to(dtype)
        for dtype in SAFETENSORS_DTYPES.values()
    }
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["bf16.large"] = torch.randn(300, 257, generator=gen).to(torch.bfloat16)
    file = tmp_path / "m.safetensors"
    save_file(tensors, file, metadata={"format": "pt"})
    ours = dict(read_safetensors(file))
    theirs = load_file(file)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8),
                           tensor.reshape(-1).view(torch.uint8)), name


def test_truncated_files_and_unknown_dtypes_are_refused(tmp_path):
    file = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64, 64)}, file)
    data = file.read_bytes()
    short = tmp_path / "short.safetensors"
    short.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="ends inside tensor w"):
        list(read_safetensors(short))
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header["w"]["dtype"] = "C64"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(data[:8] + raw + data[8 + size:])
    with pytest.raises(ValueError, match="dtype C64"):
        list(read_safetensors(odd))
