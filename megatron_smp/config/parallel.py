"""ParallelConfig: the degrees of every parallelism and the pipeline layout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_smp.config.errors import _require


# How validation messages name ParallelConfig fields: Megatron's flags by default; `smp.init`
# passes the SMP v2 keys instead so each user sees the name they wrote.
FLAG_NAMES = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "virtual_pipeline_model_parallel_size": "--virtual-pipeline-model-parallel-size",
    "hybrid_shard_degree": "hybrid_shard_degree (--smp-config)",
}


@dataclass
class ParallelConfig:
    """Degrees of every parallelism and the pipeline layout. World size = tp * cp * dp * pp
    (ep divides dp)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # None: derived from the world size at init.
    data_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Alternative to the virtual size: layers per virtual stage (Megatron's flag).
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    # Uneven pipeline split: layers on the first / last stage, the rest split evenly.
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    # Megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-
    # split: the embedding (the loss) counts as one layer of the split, so the first virtual
    # stage of the first rank (the last of the last) holds one transformer layer fewer.
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Megatron's --pipeline-model-parallel-layout: every virtual stage's layers spelled out,
    # e.g. "Et*3|(tt|)*6tmL" (pipeline_parallel.stages.megatron_pipeline_layout).
    pipeline_model_parallel_layout: Optional[str] = None
    # Chrome trace of the pipeline schedule, one file per rank (PATH.rank<r>.json).
    pipeline_timeline: Optional[str] = None
    # SMP v2 sharded data parallelism (FSDP2, `distributed.fsdp`): parameters, grads and
    # optimizer state are sharded over groups of `hybrid_shard_degree` data x context-parallel
    # ranks and replicated across the groups. 0: one group of all dp x cp ranks (full
    # sharding); 1: no sharding (replicas, like plain data parallelism).
    hybrid_shard_degree: int = 0
    # Megatron's --use-torch-fsdp2: the training loop wraps the model in FSDP2 instead of our
    # DDP (sharded over the `hybrid_shard_degree` groups above).
    use_torch_fsdp2: bool = False
    # Megatron's --no-torch-fsdp2-reshard-after-forward clears it: keep each layer's gathered
    # params from forward to backward (ZeRO-2 like: less communication, more memory).
    torch_fsdp2_reshard_after_forward: bool = True
    distributed_backend: Optional[str] = None  # None: nccl with CUDA, else gloo
    distributed_timeout_minutes: int = 10
    # Megatron's --disable-gloo-process-groups clears it: no gloo group besides the default
    # backend's (the only one we would add is the --async-save writer's).
    use_gloo_process_groups: bool = True
    # Megatron's --init-model-with-meta-device: every model chunk is built on the meta device
    # and materialised part by part on its device (with FSDP2: unit by unit while sharding).
    init_model_with_meta_device: bool = False
    # Megatron's --expert-tensor-parallel-size; None: the experts use the dense layers' TP.
    # Smaller: each stage's ranks form Megatron's expert grid etp x ep x expert-dp (see
    # parallel_state), the experts split over etp ranks.
    expert_tensor_parallel_size: Optional[int] = None

    def data_parallel_size_for(self, world_size: int) -> int:
        return world_size // (
            self.tensor_model_parallel_size
            * self.context_parallel_size
            * self.pipeline_model_parallel_size
        )

    def check_supported(self, names: Optional[dict] = None) -> None:
        """ConfigError for degrees whose capability does not exist yet (none at present;
        kept as the one place such checks go)."""

    def fsdp_shard_size(self, world_size: int) -> int:
        """Ranks of one FSDP shard group (dp x cp ranks holding different shards) for
        `hybrid_shard_degree`: 0 -> all dp x cp ranks, 1 -> 1 (no sharding), N -> N."""
        dp_cp = self.data_parallel_size_for(world_size) * self.context_parallel_size
        return dp_cp if self.hybrid_shard_degree == 0 else self.hybrid_shard_degree

    def validate(self, world_size: int, names: Optional[dict] = None) -> None:
        """Check the degrees against `world_size`. Pure: reads the config, never changes it.
        Run once, where the configs are built (`validate_configs`, `smp.init`), or, for a
        config built by hand, by `build_parallel_state` before its first collective.

        `names` maps field names to how the user spelled them (default: Megatron's flags).
        """
        name = dict(FLAG_NAMES, **(names or {}))
        for field_name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, field_name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{name[field_name]} must be a positive integer, got {value!r}",
            )
        _require(
            self.hybrid_shard_degree >= 0,
            f"{name['hybrid_shard_degree']} must be >= 0, got {self.hybrid_shard_degree}",
        )
        tp, cp, pp = (self.tensor_model_parallel_size, self.context_parallel_size,
                      self.pipeline_model_parallel_size)
        model_parallel = tp * cp * pp
        _require(
            world_size % model_parallel == 0,
            f"world size {world_size} is not divisible by {name['tensor_model_parallel_size']} "
            f"({tp}) x {name['context_parallel_size']} ({cp}) x "
            f"{name['pipeline_model_parallel_size']} ({pp}) = {model_parallel}; launch a "
            f"multiple of {model_parallel} processes or change the degrees",
        )
        data_parallel = world_size // model_parallel
        shard = self.hybrid_shard_degree
        if shard >= 2:
            # Shard groups are whole context-parallel groups times consecutive dp ranks.
            _require(
                shard % cp == 0 and (data_parallel * cp) % shard == 0,
                f"{name['hybrid_shard_degree']} ({shard}) must be a multiple of "
                f"{name['context_parallel_size']} ({cp}) and divide the data x context-parallel "
                f"size ({data_parallel * cp} = world size {world_size} / (tp {tp} x pp {pp})); "
                "use 0 to shard over all of them or 1 not to shard",
            )
        if self.data_parallel_size is not None:
            _require(
                self.data_parallel_size == data_parallel,
                f"world size {world_size} is not tp x cp x pp x dp: with tp={tp}, cp={cp}, "
                f"pp={pp} the data-parallel size must be {data_parallel}, not "
                f"{self.data_parallel_size}",
            )
        etp = self.expert_tensor_parallel_size
        if etp is None or etp == tp:
            _require(
                (data_parallel * cp) % self.expert_model_parallel_size == 0,
                f"{name['expert_model_parallel_size']} ({self.expert_model_parallel_size}) "
                f"must divide data-parallel x context-parallel size ({data_parallel} x {cp})",
            )
        else:
            # Megatron's expert grid: each pipeline stage's tp x cp x dp ranks, in order, are
            # split etp-fastest into etp x ep x expert-dp.
            _require(
                isinstance(etp, int) and etp >= 1,
                f"--expert-tensor-parallel-size must be a positive integer, got {etp!r}",
            )
            _require(
                (tp * cp * data_parallel) % (etp * self.expert_model_parallel_size) == 0,
                f"--expert-tensor-parallel-size ({etp}) x "
                f"{name['expert_model_parallel_size']} ({self.expert_model_parallel_size}) "
                f"must divide the ranks of a pipeline stage (tp {tp} x cp {cp} x dp "
                f"{data_parallel})",
            )
        if pp == 1:
            pipeline_only = {
                name["virtual_pipeline_model_parallel_size"]:
                    self.virtual_pipeline_model_parallel_size,
                "--num-layers-per-virtual-pipeline-stage":
                    self.num_layers_per_virtual_pipeline_stage,
                "--decoder-first-pipeline-num-layers": self.decoder_first_pipeline_num_layers,
                "--decoder-last-pipeline-num-layers": self.decoder_last_pipeline_num_layers,
                "--pipeline-model-parallel-layout": self.pipeline_model_parallel_layout,
                "--pipeline-timeline": self.pipeline_timeline,
            }
            given = [flag for flag, value in pipeline_only.items() if value is not None]
            _require(
                not given,
                f"{', '.join(given)} only apply with {name['pipeline_model_parallel_size']} "
                "> 1; drop them or add pipeline stages",
            )
        _require(
            self.distributed_backend in (None, "nccl", "gloo"),
            f"--distributed-backend must be nccl or gloo, got {self.distributed_backend!r}",
        )


# Context parallelism's attentions (Megatron's --cp-comm-type values).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def name_of(names: Optional[dict]) -> dict:
    """FLAG_NAMES with the caller's spellings (e.g. SMP keys) over them."""
    return dict(FLAG_NAMES, **(names or {}))
