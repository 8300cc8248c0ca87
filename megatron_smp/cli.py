"""How every entry script and tool ends on a configuration error: one line
`megatron_smp: error: ...` on stderr (from the launcher's rank 0), exit status 2 on every rank,
no traceback — as argparse ends on a malformed flag. Cheap to import (no torch)."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

from megatron_smp.config import ConfigError

# torchrun stops the other workers as soon as one exits: ranks other than 0 wait this long so
# that rank 0 prints the message before the agent terminates it.
CONFIG_ERROR_GRACE_S = 3.0
CONFIG_ERROR_STATUS = 2  # argparse's


def print_error(message: str) -> None:
    print(f"megatron_smp: error: {message}", file=sys.stderr, flush=True)


def _process_group():
    """torch.distributed when a process group exists (never imports torch itself)."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _launcher_rank() -> int:
    dist = _process_group()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def _destroy_process_group() -> None:
    dist = _process_group()
    if dist is not None:
        dist.destroy_process_group()


def run_entry(entry: Callable[[], Any]) -> int:
    """Run `entry()` and return its status (an int, else 0), process groups torn down; when
    it raises ConfigError (CheckpointError is one), print it once and exit with status 2.
    Tools end with `sys.exit(run_entry(main))`."""
    try:
        status = entry()
    except ConfigError as exc:
        if _launcher_rank() == 0:
            print_error(str(exc))
        else:
            time.sleep(CONFIG_ERROR_GRACE_S)
        _destroy_process_group()
        sys.exit(CONFIG_ERROR_STATUS)
    _destroy_process_group()
    return status if isinstance(status, int) else 0
