"""--inprocess-restart's pieces in one process: the run restarts after an exception (at most
--inprocess-max-iterations times), a ConfigError is not retried, an interrupt from another
thread (the watchdog's) ends a main thread blocked in a sleep, and aborting shuts down the
run's TCP connections -- a peer blocked reading one returns at once -- but not the store's."""
import socket
import threading
import time

import pytest

from megatron_smp.config import ConfigError
from megatron_smp.parallel_state import inprocess_attempt
from megatron_smp.resilience.inprocess import (
    InProcessRestart, RunController, _tcp_sockets, shutdown_connections,
)


def test_restarts_after_exceptions_until_the_run_returns():
    lines, attempts = [], []

    def body():
        attempts.append(inprocess_attempt())
        if len(attempts) < 3:
            raise RuntimeError(f"step failed {len(attempts)}")
        return "done"

    controller = RunController(max_iterations=2, log=lines.append)
    assert controller.run(body) == "done"
    assert attempts == [0, 1, 2] and controller.attempt == 2
    assert "RuntimeError: step failed 2; restarting in process (restart 2)" in lines[1]
    assert inprocess_attempt() == 0  # the run is over


def test_gives_up_after_max_iterations_and_never_retries_a_config_error():
    def failing():
        raise RuntimeError("always")

    with pytest.raises(RuntimeError, match="always"):
        RunController(max_iterations=1, log=lambda line: None).run(failing)
    calls = []

    def bad_flags():
        calls.append(1)
        raise ConfigError("--foo is wrong")

    with pytest.raises(ConfigError):
        RunController(log=lambda line: None).run(bad_flags)
    assert calls == [1]


def test_an_interrupt_from_another_thread_restarts_a_blocked_main_thread():
    controller = RunController(log=lambda line: None)
    seen = []

    def body():
        if controller.attempt == 0:
            threading.Timer(0.2, controller.interrupt, ("rank 1 is stuck",)).start()
            start = time.monotonic()
            try:
                time.sleep(30)  # blocked: only the interrupt ends it
            except InProcessRestart as exc:
                seen.append((str(exc), time.monotonic() - start))
                raise
        controller.interrupt("late: ignored", attempt=0)  # for the failed run: ignored
        return "resumed"

    controller.interrupt("before the run: ignored")
    assert controller.run(body) == "resumed"
    assert seen[0][0] == "rank 1 is stuck" and seen[0][1] < 5


def test_abort_shuts_down_new_connections_but_not_the_stores():
    def pair():
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        return server, client, accepted

    store_server, store_client, store_accepted = pair()
    before = _tcp_sockets()
    server, client, accepted = pair()
    accepted.settimeout(10)
    result = []
    reader = threading.Thread(target=lambda: result.append(accepted.recv(1)))
    reader.start()  # a peer waiting for data, as in a collective
    time.sleep(0.1)
    start = time.monotonic()
    count = shutdown_connections(before | {s.fileno() for s in ()},
                                 keep_ports={store_server.getsockname()[1]})
    reader.join(10)
    assert result == [b""] and time.monotonic() - start < 2  # released at once
    assert count == 2  # this process holds both ends of the one new connection
    store_client.sendall(b"x")
    assert store_accepted.recv(1) == b"x"  # the store's connection is untouched
    for sock in (store_server, store_client, store_accepted, server, client, accepted):
        sock.close()


def _ddp_freed_after_remove_hooks(rank, world_size):
    import gc
    import weakref

    import torch

    from megatron_smp.config import OptimizerConfig, ParallelConfig
    from megatron_smp.distributed import DistributedDataParallel
    from megatron_smp.parallel_state import build_parallel_state

    state = build_parallel_state(ParallelConfig())
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4), OptimizerConfig(), state)
    ddp.module(torch.ones(2, 4)).sum().backward()  # the hooks ran once
    alive = weakref.ref(ddp)
    ddp.remove_hooks()  # what a failed run does before it restarts in process
    del ddp
    gc.collect()
    return alive() is None


def test_a_failed_runs_data_parallel_wrapper_is_freed():
    """The failed run's DistributedDataParallel (its grad buffers, its process groups) is
    freed once its hooks are removed: a restart in process does not keep the old model."""
    from megatron_smp.testing import run_distributed

    assert run_distributed(_ddp_freed_after_remove_hooks, 1, timeout=120) == [True]
