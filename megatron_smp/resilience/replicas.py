"""Replica groups that leave and rejoin the job without stopping it (--fault-tolerance, over
torchft, as torchtitan's --fault_tolerance.* options use it).

The job is `--fault-tolerance-group-size` replica groups, each a training job of its own
(launched on its own: torchrun, srun, one process) with any tensor / pipeline / data
parallelism inside it, all sharing one torchft lighthouse. Every step:

1. a quorum of the groups alive now (torchft's `Manager.start_quorum`, synchronous): a group
   that has fallen behind or just started fetches the live groups' weights, optimizer and
   scheduler state and progress (torchft's checkpoint transport, HTTP) and continues from
   their iteration -- with its data loader moved to that iteration;
2. forward and backward inside the group, its own gradient reduction;
3. the gradients averaged over the participating groups (`Manager.allreduce` over a gloo
   process group re-formed at each quorum change; rank r of a group with rank r of the others);
4. `Manager.should_commit`: the optimizer steps only if every rank of the group got through
   the all-reduce. A step given up (a peer died in the middle) updates nothing; it counts as
   a skipped iteration and the next step's quorum leaves the dead group out.

What the trajectory does meanwhile: with G groups alive a step's gradient is the mean over
those G groups' batches (each group reads 1/group-size of the data, its shard, through
--global-batch-size rows per step); a dead group's shard of the steps it misses is not
trained on; a rejoined group holds its peers' weights bit for bit from its first step on.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import time
from typing import Callable, Dict, List, Optional

import torch

from megatron_smp.config import ResilienceConfig


def weights_digest(model_chunks) -> str:
    """SHA-1 of this rank's parameters, in order (equal on the same rank of every group)."""
    digest = hashlib.sha1()
    for chunk in model_chunks:
        for _, param in chunk.named_parameters():
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


class ReplicaGroups:
    """One rank's torchft Manager and what the Trainer calls around a step (see the module
    doc): `start_step(data_iterator)`, `allreduce_grads(chunks)`, `should_commit()`,
    `data_slot(dp_rank, dp_size)`, `close()`."""

    def __init__(self, config: ResilienceConfig, trainer) -> None:
        # torchft's manager server logs every quorum and commit at INFO; the log line here
        # says when the quorum changes (RUST_LOG=info brings them back).
        os.environ.setdefault("RUST_LOG", "warn")
        import torchft

        self.config, self.trainer = config, trainer
        state = trainer.state
        self.replica_id, self.group_size = (config.fault_tolerance_replica_id,
                                            config.fault_tolerance_group_size)
        self._logging = state.rank == state.world_size - 1
        timeout = datetime.timedelta(milliseconds=config.fault_tolerance_process_group_timeout_ms)
        store_addr, store_port = self._group_store(state)
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            min_replica_size=config.fault_tolerance_min_replica_size,
            use_async_quorum=False, timeout=timeout,
            rank=state.rank, world_size=state.world_size,
            store_addr=store_addr, store_port=store_port,
            lighthouse_addr=config.lighthouse(),
            replica_id=f"megatron_smp_{self.replica_id}")
        # Set by the driver that built the data: a new training iterator from the progress's
        # consumed samples (after this group took its peers' iteration).
        self.on_recovered: Optional[Callable[[], object]] = None
        self._quorum_started = False
        self._recovered = False
        self._participants: Optional[int] = None

    def _group_store(self, state):
        """(host, port) of a TCPStore this group's ranks share: the launcher's
        (MASTER_ADDR / MASTER_PORT) when there is one; a single process without one starts
        its own."""
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if state.world_size > 1:
            raise RuntimeError("--fault-tolerance: a replica group of several processes needs "
                               "MASTER_ADDR / MASTER_PORT (torchrun and srun set them)")
        from torch.distributed import TCPStore

        self._own_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return "127.0.0.1", self._own_store.port

    def _print(self, message: str) -> None:
        if self._logging:
            print(f" fault tolerance: replica group {self.replica_id}: {message}", flush=True)

    # -- the state a rejoining group fetches ---------------------------------------------------

    def _state_dict(self) -> Dict[str, object]:
        trainer = self.trainer
        self._print(f"sent iteration {trainer.progress.iteration}'s state to a recovering "
                    f"replica group, weights sha1 {weights_digest(trainer.model)}")
        return {"model": [chunk.state_dict() for chunk in trainer.model],
                "optimizer": trainer.optimizer.state_dict(),
                "scheduler": trainer.scheduler.state_dict(),
                "progress": trainer.progress.as_dict(),
                "rng": torch.get_rng_state()}

    def _load_state_dict(self, state: Dict[str, object]) -> None:
        from megatron_smp.checkpointing.record import Progress

        trainer = self.trainer
        before = trainer.progress.iteration
        for chunk, chunk_state in zip(trainer.model, state["model"]):
            chunk.load_state_dict(chunk_state)
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.scheduler.load_state_dict(state["scheduler"])
        trainer.progress = Progress(**state["progress"])
        torch.set_rng_state(state["rng"])
        self._recovered = True
        self._print(f"recovered iteration {trainer.progress.iteration}'s weights, optimizer "
                    f"and scheduler state from a live replica group (was at iteration "
                    f"{before}); weights sha1 {weights_digest(trainer.model)}")

    # -- around a step ---------------------------------------------------------------------------

    def data_slot(self, dp_rank: int, dp_size: int):
        """(rank, size) of this rank's data shard over all the replica groups."""
        return self.replica_id * dp_size + dp_rank, self.group_size * dp_size

    def join(self) -> None:
        """The first step's quorum, before the data is built: a group that starts late takes
        the live groups' iteration here and builds its data from it."""
        self._quorum()
        self._quorum_started = True

    def _quorum(self) -> None:
        start = time.perf_counter()
        self.manager.start_quorum()
        participants = self.manager.num_participants()
        if participants != self._participants:
            self._print(f"iteration {self.trainer.progress.iteration + 1}: {participants} of "
                        f"{self.group_size} replica groups in the quorum "
                        f"({time.perf_counter() - start:.2f} s)")
            self._participants = participants

    def start_step(self, data_iterator):
        """The step's quorum (recovering the peers' state if this group is behind); returns
        the data iterator to use (a new one after a recovery)."""
        if not self._quorum_started:
            self._quorum()
        self._quorum_started = False
        if self._recovered:
            self._recovered = False
            if self.on_recovered is not None:
                return self.on_recovered()
        return data_iterator

    def allreduce_grads(self, model_chunks) -> None:
        """Average this rank's reduced gradients over the participating replica groups (one
        all-reduce per dtype); a failure is recorded by the manager (no commit)."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        from megatron_smp.distributed.finalize_model_grads import _grad_of

        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for chunk in model_chunks:
            for param in chunk.parameters():
                if param.requires_grad:
                    grad = _grad_of(param)
                    if grad is not None:
                        by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            self.manager.allreduce(flat).wait()
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)

    def should_commit(self) -> bool:
        """Whether this step's update may be applied (the same on every rank of the group)."""
        committed = self.manager.should_commit()
        if not committed:
            self._print(f"iteration {self.trainer.progress.iteration + 1} not committed (a "
                        f"replica group failed during the step, or fewer than "
                        f"{self.config.fault_tolerance_min_replica_size} took part); no update")
        return committed

    def close(self) -> None:
        """The end of the run: its iteration and this rank's weights digest (equal on every
        group that finished together), then the manager's servers stop."""
        self._print(f"finished at iteration {self.trainer.progress.iteration}, weights sha1 "
                    f"{weights_digest(self.trainer.model)}")
        self.manager.shutdown(wait=False)


__all__ = ["ReplicaGroups", "weights_digest"]
