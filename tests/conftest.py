"""Test set-up: without CUDA the generated kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before any kernel module is loaded, so it is set here, at
collection time. Kernel sources go to a fresh MSA_CODEGEN_HOME per session.
"""
import os
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MSA_CODEGEN_HOME", tempfile.mkdtemp(prefix="msa_codegen_test_"))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where the kernel tests run: the GPU when there is one, else the interpreter on the CPU."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
