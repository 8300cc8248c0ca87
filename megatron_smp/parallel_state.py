"""Process groups and ranks for every parallelism, built once and passed explicitly.

Ranks are laid out in Megatron's order tp-cp-ep-dp-pp (tp varies fastest):

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank))

The experts follow Megatron's expert grid: the ranks of each pipeline stage, in the order
above, are split etp-fastest into etp x ep x expert-dp,

    rank_in_stage = tp_rank + TP * (cp_rank + CP * dp_rank)
                  = etp_rank + ETP * (ep_rank + EP * expert_dp_rank),

ETP being --expert-tensor-parallel-size (default TP). With ETP = TP expert parallelism splits
the data x context-parallel dimension (dp_cp_rank = ep_rank + EP * expert_dp_rank): the ranks
of one expert-parallel group are consecutive members of a dp x cp group, and the
expert-data-parallel group (the ranks holding the same experts, whose grads are reduced
together) takes in the context-parallel ranks. With ETP < TP an expert-parallel group spans
several TP groups.

Nothing in the library reads a global group: a module that needs a group takes the
`ParallelState` (or the group itself) in its constructor.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from megatron_smp.config import ParallelConfig

# Dimension order, fastest-varying first. "ep" is not a separate axis (it splits dp).
_ORDER = ("tp", "cp", "dp", "pp")


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value != "":
            return int(value)
    return None


def launcher_world_size() -> int:
    """World size announced by torchrun or SLURM, or 1 for a plain `python script.py`."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", "SLURM_NTASKS") or 1


def launcher_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_int("RANK", "SLURM_PROCID") or 0


def launcher_local_rank() -> int:
    return _env_int("LOCAL_RANK", "SLURM_LOCALID") or 0


def default_device() -> torch.device:
    """The accelerator of this process when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", launcher_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(
    backend: Optional[str] = None, timeout: Optional[datetime.timedelta] = None
) -> None:
    """Initialise torch.distributed from the launcher's environment, if not done already.

    Works under torchrun (env://), under SLURM srun (SLURM_PROCID/SLURM_NTASKS with
    MASTER_ADDR/MASTER_PORT exported by the batch script) and in a plain single process
    (an in-memory store, so collectives are legal no-ops and nothing listens on a port).
    Under torchrun each restart attempt (--max-restarts) initialises in a namespace of its
    own in the launcher's store, for every backend (see `_elastic_attempt_store`).
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    world_size = launcher_world_size()
    rank = launcher_rank()
    if torch.cuda.is_available():
        torch.cuda.set_device(default_device())
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    store = _elastic_attempt_store(world_size, rank, timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
        return
    dist.init_process_group(
        backend, init_method="env://", rank=rank, world_size=world_size, **kwargs
    )


def default_group_timeout() -> datetime.timedelta:
    """The collective timeout the default process group was created with
    (--distributed-timeout-minutes), torch's default when it cannot be read."""
    try:
        backend = dist.group.WORLD._get_backend(default_device())
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return default_pg_timeout


def new_group(members: List[int], **kwargs) -> dist.ProcessGroup:
    """`dist.new_group` with the default group's timeout: torch gives every new group its own
    default (30 minutes on gloo and NCCL), so without it --distributed-timeout-minutes would
    bound only the collectives over the whole world, and a rank that stops would leave the
    others waiting in a data-parallel reduction for half an hour. Collective, like
    `dist.new_group`."""
    kwargs.setdefault("timeout", default_group_timeout())
    return dist.new_group(members, **kwargs)


# --inprocess-restart's count of restarts in this process (megatron_smp.resilience.inprocess
# sets it): each forms its process groups in a namespace of the store of its own.
_INPROCESS_ATTEMPT = 0


def set_inprocess_attempt(attempt: int) -> None:
    global _INPROCESS_ATTEMPT
    _INPROCESS_ATTEMPT = attempt


def inprocess_attempt() -> int:
    """How many times this process's run restarted in process (--inprocess-restart)."""
    return _INPROCESS_ATTEMPT


def _elastic_attempt_store(
    world_size: int, rank: int, timeout: Optional[datetime.timedelta]
) -> Optional[dist.Store]:
    """Under torchrun (TORCHELASTIC_RESTART_COUNT set): a store no earlier restart attempt
    has written to; else None (plain env:// initialisation).

    When torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True, its default)
    the one store lives as long as the job, and `env://` initialisation reuses key names, so
    after a restart (--max-restarts) the new workers would read the dead attempt's keys and
    wait in init_process_group until the timeout: every key goes under the attempt's prefix.
    The restart count is only the same on every node when each node's workers failed; an
    agent whose workers were healthy restarts them for a node that rejoins without counting
    a restart. So on several nodes scripts/launch_env.sh sets
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 of each rendezvous round then hosts a new
    store (on a port the round's agents agree on), with nothing stale in it.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or attempt == "":
        return None
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout if timeout is not None else default_pg_timeout,
        multi_tenant=not agent_hosts_store,
    )
    if not agent_hosts_store:
        return (dist.PrefixStore(f"inprocess_{_INPROCESS_ATTEMPT}", store) if _INPROCESS_ATTEMPT
                else store)
    if rank == 0 and int(os.environ.get("GROUP_WORLD_SIZE") or 1) > 1 \
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0:
        warnings.warn(
            "torchrun on several nodes with --max-restarts and the agent's shared store: a "
            "restart for a rejoining node can hang in init_process_group; export "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (scripts/launch_env.sh does)")
    suffix = f"_inprocess_{_INPROCESS_ATTEMPT}" if _INPROCESS_ATTEMPT else ""
    return dist.PrefixStore(f"attempt_{attempt}{suffix}", store)


def _rank_of(coords: Dict[str, int], sizes: Dict[str, int]) -> int:
    rank, stride = 0, 1
    for dim in _ORDER:
        rank += coords[dim] * stride
        stride *= sizes[dim]
    return rank


def rank_groups(sizes: Dict[str, int], dims: Sequence[str]) -> List[List[int]]:
    """All groups of global ranks that differ only along `dims` (in grid order).

    >>> rank_groups({"tp": 2, "cp": 1, "dp": 2, "pp": 1}, ["dp"])
    [[0, 2], [1, 3]]
    """
    other = [d for d in _ORDER if d not in dims]
    groups = []
    for fixed in itertools.product(*(range(sizes[d]) for d in reversed(other))):
        fixed_coords = dict(zip(reversed(other), fixed))
        members = []
        # Enumerate the varying dims with the first of _ORDER fastest.
        varying = [d for d in _ORDER if d in dims]
        for values in itertools.product(*(range(sizes[d]) for d in reversed(varying))):
            coords = dict(fixed_coords)
            coords.update(zip(reversed(varying), values))
            members.append(_rank_of(coords, sizes))
        groups.append(sorted(members))
    groups.sort()
    return groups


@dataclass
class ParallelState:
    """Ranks and process groups of one training job.

    `*_group` are torch.distributed process groups; `*_ranks` the global ranks they hold.
    Groups of size one are real (single-member) groups, so collectives on them are no-ops.
    """

    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    sizes: Dict[str, int]
    coords: Dict[str, int]
    groups: Dict[str, dist.ProcessGroup] = field(repr=False)
    group_ranks: Dict[str, List[int]]
    expert_model_parallel_size: int = 1
    expert_model_parallel_rank: int = 0
    expert_tensor_parallel_size: int = 1
    expert_tensor_parallel_rank: int = 0
    # Built on first use by `fsdp_mesh` / `device_mesh` (FSDP2 only).
    _meshes: Dict[str, object] = field(default_factory=dict, repr=False)

    # Convenience views --------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.groups["tp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.groups["pp"]

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.groups["dp"]

    @property
    def cp_size(self) -> int:
        return self.sizes["cp"]

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.groups["cp"]

    @property
    def tp_cp_group(self) -> dist.ProcessGroup:
        """Ranks splitting one sequence: tensor- (sequence-) and context-parallel."""
        return self.groups["tp_cp"]

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """Ranks holding the same (non-expert) parameters: grads are reduced over this group."""
        return self.groups["dp_cp"]

    @property
    def dp_cp_size(self) -> int:
        return self.sizes["dp"] * self.sizes["cp"]

    @property
    def dp_cp_rank(self) -> int:
        return self.group_ranks["dp_cp"].index(self.rank)

    @property
    def ep_size(self) -> int:
        return self.expert_model_parallel_size

    @property
    def ep_rank(self) -> int:
        return self.expert_model_parallel_rank

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.groups["ep"]

    @property
    def etp_size(self) -> int:
        """Ranks one expert is split over (--expert-tensor-parallel-size, default TP)."""
        return self.expert_tensor_parallel_size

    @property
    def etp_rank(self) -> int:
        return self.expert_tensor_parallel_rank

    @property
    def etp_group(self) -> dist.ProcessGroup:
        """The ranks holding the parts of this rank's experts (the TP group when ETP = TP)."""
        return self.groups["etp"]

    @property
    def tp_ep_group(self) -> dist.ProcessGroup:
        """The expert-tensor- and expert-parallel ranks of this rank's experts, at position
        ep_rank * etp_size + etp_rank (the flex token dispatcher's group)."""
        return self.groups["tp_ep"]

    @property
    def expert_dp_group(self) -> dist.ProcessGroup:
        """Ranks holding the same experts: expert grads are reduced over this group."""
        return self.groups["expert_dp"]

    @property
    def model_parallel_group(self) -> dist.ProcessGroup:
        """tp x pp: the ranks that together hold one copy of the model (for grad norms)."""
        return self.groups["mp"]

    @property
    def embedding_group(self) -> Optional[dist.ProcessGroup]:
        """First and last pipeline stage of this tp/cp/dp position (tied embeddings)."""
        return self.groups.get("embedding")

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_prev_rank(self) -> int:
        ranks = self.group_ranks["pp"]
        return ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def pp_next_rank(self) -> int:
        ranks = self.group_ranks["pp"]
        return ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def is_in_embedding_group(self) -> bool:
        return self.rank in self.group_ranks.get("embedding", [])

    # Sharded data parallelism (FSDP2) ---------------------------------------------------------
    @property
    def fsdp_shard_size(self) -> int:
        """Ranks of this rank's FSDP shard group (`hybrid_shard_degree`, 0 = all dp x cp)."""
        return self.config.fsdp_shard_size(self.world_size)

    def _build_fsdp_groups(self) -> None:
        # Shard groups are runs of `fsdp_shard_size` consecutive members of each dp x cp group
        # (whole cp groups, consecutive dp ranks); replicate groups hold the same position in
        # every run. Collective: every rank builds them, in the same order.
        if "fsdp_shard" in self.groups:
            return
        shard = self.fsdp_shard_size
        shard_groups, replicate_groups = [], []
        for members in rank_groups(self.sizes, ["cp", "dp"]):
            for start in range(0, len(members), shard):
                shard_groups.append(members[start : start + shard])
            for offset in range(shard):
                replicate_groups.append(members[offset::shard])
        self._new_groups((("fsdp_shard", shard_groups), ("fsdp_replicate", replicate_groups)))

    def optimizer_instance_groups(self, instances: int):
        """--num-distributed-optimizer-instances (Megatron's partial distributed optimizer):
        {"dense": (intra, inter), "expert": (intra, inter)}. Each dp x cp group (expert-dp
        group) splits into `instances` runs of consecutive members: the distributed
        optimizer shards within a run (intra) and the members at the same place of every run
        (inter) all-reduce their shard; (None, None) for experts whose expert-dp groups do
        not divide (validation refuses that for a model with experts). Collective on first
        use: every rank must ask."""
        name = f"dist_opt_{instances}"
        if f"{name}_intra" not in self.groups:
            groups: Dict[str, List[List[int]]] = {
                f"{name}{kind}": [] for kind in ("_intra", "_inter", "_expert_intra",
                                                 "_expert_inter")}
            for base, key in (("dp_cp", name), ("expert_dp", f"{name}_expert")):
                for members in self._all_groups(base):
                    size = len(members) // instances
                    if len(members) % instances:  # experts: refused where they exist
                        break
                    groups[f"{key}_intra"] += [members[i * size:(i + 1) * size]
                                               for i in range(instances)]
                    groups[f"{key}_inter"] += [members[offset::size] for offset in range(size)]
            self._new_groups(sorted(groups.items()))
        return {"dense": (self.groups[f"{name}_intra"], self.groups[f"{name}_inter"]),
                "expert": (self.groups.get(f"{name}_expert_intra"),
                           self.groups.get(f"{name}_expert_inter"))}

    def _all_groups(self, name: str) -> List[List[int]]:
        """Every group of kind "dp_cp" or "expert_dp" (members in rank order)."""
        if name == "dp_cp":
            return rank_groups(self.sizes, ["cp", "dp"])
        etp, ep = self.etp_size, self.ep_size
        stage = self.sizes["tp"] * self.sizes["cp"] * self.sizes["dp"]
        expert_dp = stage // (etp * ep)
        return [[p * stage + t + etp * (a + ep * e) for e in range(expert_dp)]
                for p in range(self.sizes["pp"]) for t in range(etp) for a in range(ep)]

    def _new_groups(self, named_groups) -> None:
        """Create every group of each (name, [members...]) in a rank-independent order (a
        collective: all ranks call it alike) and keep the one this rank belongs to."""
        for name, all_groups in named_groups:
            for members in sorted(all_groups):
                group = new_group(members)
                if self.rank in members:
                    self.groups[name] = group
                    self.group_ranks[name] = members

    @property
    def fsdp_shard_group(self) -> dist.ProcessGroup:
        """Ranks holding different shards of the same (TP-local) parameters. Collective on
        first access (of this or `fsdp_mesh`): every rank must ask."""
        self._build_fsdp_groups()
        return self.groups["fsdp_shard"]

    @property
    def fsdp_mesh(self):
        """The DeviceMesh FSDP2 shards over, built from this state's own groups: 1-D
        ("dp_shard_cp",) for full sharding, else 2-D ("dp_replicate", "dp_shard_cp") for
        hybrid sharding (replicate across, shard within). Collective on first access."""
        if "fsdp" not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self._build_fsdp_groups()
            shard = self.group_ranks["fsdp_shard"]
            replicate = self.group_ranks["fsdp_replicate"]
            device_type = self.device.type
            if len(replicate) == 1:
                mesh = DeviceMesh.from_group(self.groups["fsdp_shard"], device_type,
                                             mesh_dim_names=("dp_shard_cp",))
            else:
                # Row r is the shard group of replica r: the dp x cp members of a group are
                # an arithmetic progression, so every shard group is a translate of ours.
                layout = [[member - self.rank + r for member in shard] for r in replicate]
                mesh = DeviceMesh.from_group(
                    [self.groups["fsdp_replicate"], self.groups["fsdp_shard"]], device_type,
                    mesh=torch.tensor(layout, dtype=torch.int),
                    mesh_dim_names=("dp_replicate", "dp_shard_cp"),
                )
            self._meshes["fsdp"] = mesh
        return self._meshes["fsdp"]

    def check_expert_fsdp_layout(self) -> None:
        """Expert params shard within this rank's FSDP shard group, over the members holding
        the same experts: that needs whole EP groups per shard group or whole shard groups
        per EP group (pure: raise on every rank before any collective)."""
        from megatron_smp.config import ConfigError

        shard, ep = self.fsdp_shard_size, self.ep_size
        if shard % ep and ep % shard:
            raise ConfigError(
                f"hybrid_shard_degree {self.config.hybrid_shard_degree} with "
                f"expert_parallel_degree {ep}: one must divide the other so that the experts "
                "shard within the FSDP shard groups"
            )

    def _build_expert_fsdp_groups(self) -> None:
        # Expert params are sharded (FSDP) over the members of this rank's FSDP shard group
        # that hold the same experts (same ep rank), and replicated across the members of the
        # expert-data-parallel group at the same position of another such group. With
        # hybrid_shard_degree 0 that is sharding over the whole expert-data-parallel group.
        if "expert_fsdp_shard" in self.groups:
            return
        self.check_expert_fsdp_layout()
        shard_groups, replicate_groups = [], []
        for members in rank_groups(self.sizes, ["cp", "dp"]):
            shards, replicas = expert_fsdp_layout(members, self.fsdp_shard_size, self.ep_size)
            shard_groups += shards
            replicate_groups += replicas
        self._new_groups((("expert_fsdp_shard", shard_groups),
                          ("expert_fsdp_replicate", replicate_groups)))

    @property
    def expert_fsdp_groups(self) -> Tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(shard group, replicate group) of the expert params under FSDP (see
        `_build_expert_fsdp_groups`). Collective on first access: every rank must ask."""
        self._build_expert_fsdp_groups()
        return self.groups["expert_fsdp_shard"], self.groups["expert_fsdp_replicate"]

    @property
    def expert_fsdp_mesh(self):
        """The DeviceMesh FSDP2 shards expert params over: as `fsdp_mesh`, over the ranks
        holding the same experts. Collective on first access."""
        if "expert_fsdp" not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            shard_group, replicate_group = self.expert_fsdp_groups
            shard = self.group_ranks["expert_fsdp_shard"]
            replicate = self.group_ranks["expert_fsdp_replicate"]
            if len(replicate) == 1:
                mesh = DeviceMesh.from_group(shard_group, self.device.type,
                                             mesh_dim_names=("expert_shard",))
            else:
                # Row r: the shard group of replica r, a translate of ours.
                layout = [[member - self.rank + r for member in shard] for r in replicate]
                mesh = DeviceMesh.from_group(
                    [replicate_group, shard_group], self.device.type,
                    mesh=torch.tensor(layout, dtype=torch.int),
                    mesh_dim_names=("expert_replicate", "expert_shard"),
                )
            self._meshes["expert_fsdp"] = mesh
        return self._meshes["expert_fsdp"]

    @property
    def device_mesh(self):
        """The whole grid as a DeviceMesh with named axes ("pp", "dp", "cp", "tp"), made of
        this state's own groups (no new communicator), so `device_mesh["tp"]` is `tp_group`."""
        if "grid" not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            sizes = [self.sizes[d] for d in reversed(_ORDER)]
            layout = torch.arange(self.world_size, dtype=torch.int).reshape(sizes)
            self._meshes["grid"] = DeviceMesh.from_group(
                [self.groups[d] for d in reversed(_ORDER)], self.device.type, mesh=layout,
                mesh_dim_names=tuple(reversed(_ORDER)),
            )
        return self._meshes["grid"]

    def __repr__(self) -> str:  # keep logs short
        dims = ", ".join(f"{d}={self.coords[d]}/{self.sizes[d]}" for d in _ORDER)
        return f"ParallelState(rank={self.rank}/{self.world_size}, {dims}, ep={self.ep_rank}/{self.ep_size})"


def expert_fsdp_layout(members: Sequence[int], shard: int, ep: int
                       ) -> Tuple[List[List[int]], List[List[int]]]:
    """(shard groups, replicate groups) of expert params over one dp x cp group `members`
    (in order; the FSDP shard groups are runs of `shard` of them, the EP groups runs of `ep`):
    a shard group is the members of one FSDP shard group with the same ep rank, a replicate
    group the members with the same ep rank at the same place of their shard group."""
    shard_groups, position = [], {}
    for start in range(0, len(members), shard):
        for ep_rank in range(ep):
            group = [members[i] for i in range(start, start + shard) if i % ep == ep_rank]
            if group:
                shard_groups.append(group)
                for index, member in enumerate(group):
                    position[member] = (ep_rank, index)
    by_position: Dict[tuple, List[int]] = {}
    for member in members:
        by_position.setdefault(position[member], []).append(member)
    return shard_groups, list(by_position.values())


def build_parallel_state(
    config: Optional[ParallelConfig] = None,
    *,
    backend: Optional[str] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> ParallelState:
    """Check `config` against the world size, then create every process group: the entry
    point for a layout built by hand.

    The check runs on every rank before the first collective, so a layout that cannot work
    raises `ConfigError` everywhere instead of hanging. The training scripts, `smp.init` and
    the inference launcher check their configs where they build them (`validate_configs`,
    `parse_smp_config`) and call `create_parallel_state`, which does not check again.
    """
    config = config or ParallelConfig()
    config.validate(launcher_world_size())
    return create_parallel_state(config, backend=backend, timeout=timeout)


def create_parallel_state(
    config: ParallelConfig,
    *,
    backend: Optional[str] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> ParallelState:
    """Create every process group of the layout a validated `config` describes (collective).
    Its world size is the launcher's (`launcher_world_size`), the one it was validated with."""
    init_process_group(backend or config.distributed_backend, timeout)
    world_size = dist.get_world_size()
    rank = dist.get_rank()

    tp = config.tensor_model_parallel_size
    cp = config.context_parallel_size
    pp = config.pipeline_model_parallel_size
    dp = config.data_parallel_size_for(world_size)
    # The state keeps its own copy with the derived size; the caller's config is not changed.
    config = dataclasses.replace(config, data_parallel_size=dp)
    ep = config.expert_model_parallel_size
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    remainder = rank
    coords = {}
    for dim in _ORDER:
        coords[dim] = remainder % sizes[dim]
        remainder //= sizes[dim]

    groups: Dict[str, dist.ProcessGroup] = {}
    group_ranks: Dict[str, List[int]] = {}

    def create(name: str, all_groups: List[List[int]]) -> None:
        # Every rank must call new_group for every group, in the same order.
        for members in all_groups:
            group = new_group(members)
            if rank in members:
                groups[name] = group
                group_ranks[name] = members

    create("tp", rank_groups(sizes, ["tp"]))
    create("cp", rank_groups(sizes, ["cp"]))
    create("dp", rank_groups(sizes, ["dp"]))
    create("pp", rank_groups(sizes, ["pp"]))
    create("dp_cp", rank_groups(sizes, ["cp", "dp"]))
    create("mp", rank_groups(sizes, ["tp", "pp"]))
    create("tp_cp", rank_groups(sizes, ["tp", "cp"]))

    # Expert grid (see the module docstring): per pipeline stage, etp-fastest. With ETP = TP
    # an ep group is a run of consecutive members of a dp x cp group (cp fastest); members
    # with the same ep rank hold the same experts. Every context-parallel rank routes its own
    # tokens, so the experts see tokens of all of them.
    etp = config.expert_tensor_parallel_size or tp
    stage = tp * cp * dp
    expert_dp = stage // (etp * ep)

    def expert_rank(stage_start: int, t: int, a: int, e: int) -> int:
        return stage_start + t + etp * (a + ep * e)

    stages = [p * stage for p in range(pp)]
    ep_groups = sorted([expert_rank(s0, t, a, e) for a in range(ep)]
                       for s0 in stages for t in range(etp) for e in range(expert_dp))
    create("ep", ep_groups)
    create("expert_dp", sorted([expert_rank(s0, t, a, e) for e in range(expert_dp)]
                               for s0 in stages for t in range(etp) for a in range(ep)))
    if etp == tp:
        groups["etp"], group_ranks["etp"] = groups["tp"], group_ranks["tp"]
    else:
        create("etp", sorted([expert_rank(s0, t, a, e) for t in range(etp)]
                             for s0 in stages for a in range(ep) for e in range(expert_dp)))
    # Megatron's etp x ep group (the flex token dispatcher's one all-to-all): a block of
    # etp x ep consecutive ranks of a stage, so a member's position in it is
    # ep_rank * ETP + etp_rank.
    if etp > 1 and ep > 1:
        create("tp_ep", sorted([expert_rank(s0, t, a, e) for a in range(ep) for t in range(etp)]
                               for s0 in stages for e in range(expert_dp)))
    else:
        alias = "ep" if etp == 1 else "etp"
        groups["tp_ep"], group_ranks["tp_ep"] = groups[alias], group_ranks[alias]

    # Embedding group: first and last pipeline stage, for tied input/output embeddings.
    embedding_groups = []
    for members in rank_groups(sizes, ["pp"]):
        embedding_groups.append(sorted({members[0], members[-1]}))
    create("embedding", embedding_groups)

    ep_rank = group_ranks["ep"].index(rank)
    etp_rank = group_ranks["etp"].index(rank)
    return ParallelState(
        config=config,
        rank=rank,
        world_size=world_size,
        device=default_device(),
        sizes=sizes,
        coords=coords,
        groups=groups,
        group_ranks=group_ranks,
        expert_model_parallel_size=ep,
        expert_model_parallel_rank=ep_rank,
        expert_tensor_parallel_size=etp,
        expert_tensor_parallel_rank=etp_rank,
    )


def local_parallel_state() -> ParallelState:
    """A state of this rank alone (every size 1, every group this rank only), for a model
    that one rank runs whole beside the job's layout (the draft model of speculative
    decoding on the inference leader). Needs an initialised process group; only this rank
    takes part in creating its groups."""
    rank = dist.get_rank()
    group = dist.new_group([rank], use_local_synchronization=True)
    names = ("tp", "cp", "dp", "pp", "dp_cp", "mp", "tp_cp", "ep", "etp", "tp_ep", "expert_dp",
             "embedding")
    return ParallelState(
        config=ParallelConfig(), rank=rank, world_size=dist.get_world_size(),
        device=default_device(), sizes={"tp": 1, "cp": 1, "dp": 1, "pp": 1},
        coords={"tp": 0, "cp": 0, "dp": 0, "pp": 0},
        groups={name: group for name in names},
        group_ranks={name: [rank] for name in names},
    )


def destroy_parallel_state() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank_zero_print(state: Optional[ParallelState], *args, **kwargs) -> None:
    rank = state.rank if state is not None else launcher_rank()
    if rank == 0:
        print(*args, **kwargs, flush=True)


__all__ = [
    "ParallelState",
    "build_parallel_state",
    "create_parallel_state",
    "local_parallel_state",
    "destroy_parallel_state",
    "init_process_group",
    "new_group",
    "default_group_timeout",
    "rank_groups",
    "default_device",
    "launcher_world_size",
    "launcher_rank",
    "rank_zero_print",
]
