"""Megatron's distributed optimizer (ZeRO-1 over the contiguous grad buffers), and with
Muon or Lion its layer-wise form.

Every bucket of every grad buffer is cut into dp equal contiguous shards (the buffer pads
each bucket for this); data-parallel rank i owns shard i of each bucket:

* the DDP reduce-scatter leaves the averaged grads of shard i on rank i;
* rank i keeps fp32 main params and optimizer state only for the param pieces inside its
  shards (fp16/bf16 pieces are cloned to fp32, fp32 pieces are views of the model params);
* after the step, the updated shards are written into the param buffer and all-gathered.

Ranges (`Range`) are kept at three levels for each bucket: the world ranges of every DP rank
(`world_all`), this rank's range (`world`, in buffer coordinates, and `local`, relative to
the shard) and, per param overlapping it, the piece's position in the buffer (`gbuf_world`),
in the shard (`gbuf_local`) and inside the flattened param (`param`).

Layer-wise (`--optimizer muon|lion --use-distributed-optimizer`, Megatron's
LayerWiseDistributedOptimizer): the buffers place every param whole inside one rank's shard,
balanced by size (`param_and_grad_buffer.layer_wise_shard_layout`), so the same
reduce-scatter, step on this rank's params and all-gather (overlapped with
--overlap-param-gather) hand each rank whole matrices to orthogonalise. The optimizer state
per rank is then the state of the params its shards hold: 1/DP of the whole up to the
balance the placement achieves.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch

from megatron_smp.config import ConfigError
from megatron_smp.optimizer.optimizer import HALF_DTYPES, MegatronOptimizer


class Range:
    """A [start, end) interval for indexing a shard out of a flat tensor."""

    def __init__(self, start: int, end: int):
        self.start = start
        self.end = end
        self.size = end - start

    def normalize(self, start: int = 0) -> "Range":
        """The same length, moved to begin at `start`."""
        return Range(start, start + self.size)

    def __len__(self) -> int:
        return self.size

    def __eq__(self, other) -> bool:
        return isinstance(other, Range) and (self.start, self.end) == (other.start, other.end)

    def __repr__(self) -> str:
        return f"Range({self.start}, {self.end} [{self.size}])"


class DistributedOptimizer(MegatronOptimizer):
    """Shards main params, grads and optimizer state over data-parallel ranks.

    Args:
        optimizer_factory: builds the torch optimizer from param groups (of main shards).
        model_chunks: `DistributedDataParallel` instances built with
            `use_distributed_optimizer=True`.
        param_groups: groups of *model* params (with wd_mult etc.), as from `get_param_groups`.
    """

    grads_sharded_over_dp = True

    def __init__(
        self, optimizer_factory: Callable, config, state, model_chunks, param_groups,
        grad_scaler=None,
    ):
        for chunk in model_chunks:
            if not getattr(chunk, "use_distributed_optimizer", False):
                raise ConfigError(
                    "--use-distributed-optimizer needs every model chunk wrapped in "
                    "megatron_smp.distributed.DistributedDataParallel built with the same "
                    "OptimizerConfig (use_distributed_optimizer=True)"
                )
        self.param_and_grad_buffers = [
            buffer for chunk in model_chunks for buffer in chunk.param_and_grad_buffers
        ]
        self.model_gbuf_ranges = [
            self.build_model_gbuf_range_map(buffer) for buffer in self.param_and_grad_buffers
        ]
        self.model_param_gbuf_map = self.build_model_param_gbuf_map(self.model_gbuf_ranges)
        self.model_param_group_index_map, self.opt_group_ranges = self.build_optimizer_group_ranges(
            param_groups, self.model_gbuf_ranges
        )
        (
            self.model_float16_groups,
            self.model_fp32_groups,
            self.shard_float16_groups,
            self.shard_fp32_groups,
            self.shard_fp32_from_float16_groups,
        ) = self.build_model_and_main_param_groups(
            self.model_gbuf_ranges, self.model_param_gbuf_map, self.opt_group_ranges
        )
        main_groups = []
        for group_range, fp32_shards, main_shards in zip(
            self.opt_group_ranges, self.shard_fp32_groups, self.shard_fp32_from_float16_groups
        ):
            orig = {k: v for k, v in group_range["orig_group"].items() if k != "params"}
            main_groups.append({**orig, "params": [*fp32_shards, *main_shards]})
        super().__init__(optimizer_factory(main_groups), config, state, model_chunks, grad_scaler)
        for index in range(len(self.opt_group_ranges)):
            self.param_pairs += list(
                zip(self.model_fp32_groups[index], self.shard_fp32_groups[index])
            )
            self.param_pairs += list(
                zip(self.model_float16_groups[index], self.shard_fp32_from_float16_groups[index])
            )
        self._pair_param_ranges = [self._param_range(model) for model, _ in self.param_pairs]

    # Range construction (seed names) -----------------------------------------------------------
    @staticmethod
    def build_model_gbuf_param_range_map(
        param_world_index_map: Dict, gbuf_world_range: Range, bucket_index: int
    ) -> Dict:
        """For each param of the bucket overlapping this rank's range: its piece's ranges."""
        param_range_map = {}
        for param, (param_world_start, param_world_end, index) in param_world_index_map.items():
            if index != bucket_index:
                continue
            param_local_start = max(0, param_world_start - gbuf_world_range.start)
            param_local_end = min(gbuf_world_range.size, param_world_end - gbuf_world_range.start)
            if param_local_end > param_local_start:
                param_local_range = Range(param_local_start, param_local_end)
                param_world_range = param_local_range.normalize(
                    param_local_start + gbuf_world_range.start
                )
                sub_param_start = max(0, gbuf_world_range.start - param_world_start)
                param_range_map[param] = {
                    "gbuf_world": param_world_range,
                    "gbuf_local": param_local_range,
                    "param": param_local_range.normalize(sub_param_start),
                }
        return param_range_map

    @classmethod
    def build_model_gbuf_range(cls, buffer, bucket_index: int) -> Dict:
        """World ranges of every DP rank in one bucket, this rank's, and its params' pieces."""
        bucket = buffer.buckets[bucket_index]
        world_size = buffer.data_parallel_world_size
        bucket_size = bucket.grad_data.numel()
        if bucket_size % world_size:
            raise RuntimeError(
                f"bucket {bucket_index} ({bucket_size}) is not padded to dp={world_size}"
            )
        max_range_size = bucket_size // world_size
        world_all = [
            Range(bucket.offset + r * max_range_size, bucket.offset + (r + 1) * max_range_size)
            for r in range(world_size)
        ]
        world = world_all[buffer.data_parallel_rank]
        return {
            "local": world.normalize(),
            "world": world,
            "world_all": world_all,
            "param_map": cls.build_model_gbuf_param_range_map(
                buffer.param_index_map, world, bucket_index
            ),
            "max_range_size": max_range_size,
        }

    @classmethod
    def build_model_gbuf_range_map(cls, buffer) -> List[Dict]:
        """The ranges of every bucket of one buffer."""
        return [cls.build_model_gbuf_range(buffer, i) for i in range(len(buffer.buckets))]

    @staticmethod
    def build_model_param_gbuf_map(model_gbuf_ranges: List[List[Dict]]) -> Dict:
        """Reverse map: param -> (buffer index, bucket index), for params in this rank's shards."""
        param_gbuf_map = {}
        for gbuf_index, bucket_ranges in enumerate(model_gbuf_ranges):
            for bucket_index, gbuf_range in enumerate(bucket_ranges):
                for param in gbuf_range["param_map"]:
                    param_gbuf_map[param] = (gbuf_index, bucket_index)
        return param_gbuf_map

    @staticmethod
    def build_optimizer_group_ranges(
        param_groups: List[Dict], model_gbuf_ranges: List[List[Dict]]
    ) -> Tuple[Dict, List[Dict]]:
        """Which of this rank's params fall into which optimizer group.

        Returns ({param: (group index, position in group)}, [{"params", "orig_group",
        "orig_group_idx"}] per group, possibly with no params on this rank).
        """
        world_param_group_map = {}
        for group_index, group in enumerate(param_groups):
            for param in group["params"]:
                world_param_group_map[param] = group_index
        local_param_group_map = {}
        group_ranges = [{"params": []} for _ in param_groups]
        for bucket_ranges in model_gbuf_ranges:
            for gbuf_range in bucket_ranges:
                for param in gbuf_range["param_map"]:
                    if param not in world_param_group_map:
                        raise ValueError(
                            "a parameter of the DDP buffers is in no optimizer param group; "
                            "pass every trainable parameter to get_megatron_optimizer"
                        )
                    group_range = group_ranges[world_param_group_map[param]]
                    group_range["params"].append(param)
                    local_param_group_map[param] = (
                        world_param_group_map[param], len(group_range["params"]) - 1
                    )
        for group_index, group_range in enumerate(group_ranges):
            group_range["orig_group"] = param_groups[group_index]
            group_range["orig_group_idx"] = group_index
        return local_param_group_map, group_ranges

    @staticmethod
    def build_model_and_main_param_groups(
        model_gbuf_ranges: List[List[Dict]], param_gbuf_map: Dict, opt_group_ranges: List[Dict]
    ):
        """Per group: model params (fp16/bf16 and fp32), their shards, and fp32 main shards.

        fp16/bf16 shards are cloned to fp32 (the optimizer's main params); fp32 shards are
        views of the model params, so the optimizer updates the param buffer directly.
        """
        model_float16_groups, model_fp32_groups = [], []
        shard_float16_groups, shard_fp32_groups, shard_fp32_from_float16_groups = [], [], []
        for group_range in opt_group_ranges:
            model_float16, model_fp32, shard_float16, shard_fp32, shard_main = [], [], [], [], []
            for model_param in group_range["params"]:
                gbuf_index, bucket_index = param_gbuf_map[model_param]
                param_range = model_gbuf_ranges[gbuf_index][bucket_index]["param_map"][
                    model_param
                ]["param"]
                flat = model_param.detach().view(-1)
                shard_model_param = flat[param_range.start : param_range.end]
                if param_range.size == model_param.numel():
                    # A whole param (always so in the layer-wise layout) keeps its shape:
                    # Muon orthogonalises it as the matrix it is.
                    shard_model_param = shard_model_param.view(model_param.shape)
                if model_param.dtype in HALF_DTYPES:
                    model_float16.append(model_param)
                    shard_float16.append(shard_model_param)
                    shard_main.append(shard_model_param.float())
                elif model_param.dtype == torch.float32:
                    model_fp32.append(model_param)
                    shard_fp32.append(shard_model_param)
                else:
                    raise TypeError(
                        f"the distributed optimizer handles fp32, fp16 and bf16 params, "
                        f"not {model_param.dtype}"
                    )
            model_float16_groups.append(model_float16)
            model_fp32_groups.append(model_fp32)
            shard_float16_groups.append(shard_float16)
            shard_fp32_groups.append(shard_fp32)
            shard_fp32_from_float16_groups.append(shard_main)
        return (
            model_float16_groups,
            model_fp32_groups,
            shard_float16_groups,
            shard_fp32_groups,
            shard_fp32_from_float16_groups,
        )

    # Step ---------------------------------------------------------------------------------------
    def _param_range(self, model_param) -> Range:
        gbuf_index, bucket_index = self.model_param_gbuf_map[model_param]
        return self.model_gbuf_ranges[gbuf_index][bucket_index]["param_map"][model_param]["param"]

    def _copy_model_grads_to_main_grads(self) -> None:
        """Point each main shard's .grad at its piece of the reduce-scattered grad buffer
        (an alias for fp32 grads, an fp32 copy otherwise)."""
        pairs = zip(self.param_pairs, self._pair_param_ranges)
        for (model_param, main_param), param_range in pairs:
            shard_grad = model_param.main_grad.view(-1)[param_range.start : param_range.end]
            main_param.grad = shard_grad.view(main_param.shape).float()

    def _copy_main_params_to_model_params(self) -> None:
        for shard_models, shard_mains in zip(
            self.shard_float16_groups, self.shard_fp32_from_float16_groups
        ):
            for shard_model, shard_main in zip(shard_models, shard_mains):
                shard_model.copy_(shard_main)

    def _start_param_sync(self) -> None:
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for shard_models, shard_mains in zip(
                self.shard_float16_groups, self.shard_fp32_from_float16_groups
            ):
                for shard_model, shard_main in zip(shard_models, shard_mains):
                    shard_main.copy_(shard_model)

    # Checkpoints --------------------------------------------------------------------------------
    def param_shards(self) -> List[Dict]:
        """This rank's piece of every param it owns, for checkpoints that reshard.

        Each entry: `name` (as in the chunk's module), `param` (the model param), `range`
        (a Range into the flattened param), `main_param` (the fp32 shard the optimizer
        updates) and `optimizer_state` (its state dict, e.g. exp_avg / exp_avg_sq, 1-D).
        Over all DP ranks the ranges of one param tile [0, numel) exactly once.
        """
        names = {}
        for buffer in self.param_and_grad_buffers:
            names.update(buffer.param_names)
        return [
            {
                "name": names.get(model_param, ""),
                "param": model_param,
                "range": param_range,
                "main_param": main_param,
                "optimizer_state": self.optimizer.state.get(main_param, {}),
            }
            for (model_param, main_param), param_range in zip(
                self.param_pairs, self._pair_param_ranges
            )
        ]

    def _layout(self) -> List[List[Tuple[int, int]]]:
        return [
            [(r["world"].start, r["world"].end) for r in ranges]
            for ranges in self.model_gbuf_ranges
        ]

    def state_dict(self) -> dict:
        """This rank's shard: inner optimizer state, fp32 main shards, and the shard layout
        (loading needs the same DP size and bucket layout)."""
        state_dict = super().state_dict()
        state_dict["shard_fp32_from_float16_groups"] = self.shard_fp32_from_float16_groups
        state_dict["shard_layout"] = self._layout()
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("shard_layout") != self._layout():
            raise ConfigError(
                "the distributed-optimizer checkpoint was saved with a different "
                "data-parallel size or --ddp-bucket-size; resume with the same layout"
            )
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for mains, saved in zip(
                self.shard_fp32_from_float16_groups, state_dict["shard_fp32_from_float16_groups"]
            ):
                for main, value in zip(mains, saved):
                    main.copy_(value)
