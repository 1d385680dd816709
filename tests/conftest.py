import os

import pytest
import torch

# Keep unit tests quick and reproducible on a 2-core machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny-model tests: on a loaded 2-core machine a second
    thread costs more than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def count_parameters():
    """Parameters of a module as ``model.parameters()`` lists them (a tied weight once)."""
    return lambda model: sum(p.numel() for p in model.parameters())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
