import pytest
import torch


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The main job sets torch's thread count for its process; tests that run it in-process put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
