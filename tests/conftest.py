import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster when the CPUs are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def uncapped_device_memory():
    """A model built with a VRAM budget caps the process's CUDA allocator
    (torch.cuda.set_per_process_memory_fraction, process-wide): lift the cap after each test, so
    a later test's model is not refused memory under an earlier test's budget (run 38 lost three
    CUDA tests that way)."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(1.0, index)
