"""Suite-wide hygiene: a test that initialises torch.distributed in the pytest process
(single-process runs need no launcher) must not leak that process group into later tests,
which would then see its world size instead of the launcher environment they set up."""
import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_sessionstart(session):
    """The fake accelerator (tests/fake_device) is registered before any test runs: the
    autograd engine sizes its per-device queues at a process's first backward, so a device
    registered after that fails every backward on it -- and with the suite spread over
    workers, any test may come first."""
    from tests.fake_device.harness import register_fake_device

    register_fake_device()
