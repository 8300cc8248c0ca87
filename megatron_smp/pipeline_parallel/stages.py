"""Which layers each pipeline stage holds, and building this rank's model chunks.

Layers are split evenly over --pipeline-model-parallel-size stages, or unevenly with
--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (the remaining
layers are split evenly over the stages in between). With virtual stages
(--virtual-pipeline-model-parallel-size v, or --num-layers-per-virtual-pipeline-stage) each
rank holds v chunks and chunk c of rank r is virtual stage c * pp + r, so a microbatch
visits every rank v times. The embedding lives on virtual stage 0 (rank 0, chunk 0), the
output layer and the loss on the last one (last rank, last chunk).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from megatron_smp.config import ConfigError
from megatron_smp.pipeline_parallel.schedules import check_virtual_microbatches, schedule_name


@dataclass
class StageSpec:
    """One model chunk's place in the pipeline; attached to the chunk as `pipeline_stage`.

    The schedules read it to find the parallel state, the shape and dtype of the hidden
    states exchanged between stages, and the timeline.
    """

    state: object
    chunk_index: int
    layer_offset: int
    num_layers: int
    pre_process: bool
    post_process: bool
    hidden_size: int
    sequence_parallel: bool
    dtype: torch.dtype
    timeline: Optional[object] = None


def _virtual_size(
    num_layers: int,
    pipeline_size: int,
    virtual_size: Optional[int],
    layers_per_virtual_stage: Optional[int],
) -> int:
    if layers_per_virtual_stage is None:
        return virtual_size or 1
    if layers_per_virtual_stage < 1 or num_layers % (pipeline_size * layers_per_virtual_stage):
        raise ConfigError(
            f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size "
            f"({pipeline_size}) x --num-layers-per-virtual-pipeline-stage "
            f"({layers_per_virtual_stage})"
        )
    derived = num_layers // (pipeline_size * layers_per_virtual_stage)
    if virtual_size is not None and virtual_size != derived:
        raise ConfigError(
            f"--virtual-pipeline-model-parallel-size ({virtual_size}) contradicts "
            f"--num-layers-per-virtual-pipeline-stage ({layers_per_virtual_stage}), which "
            f"gives {derived} virtual stages for {num_layers} layers over {pipeline_size} "
            "stages; give only one of them"
        )
    return derived


def _layers_per_stage(
    num_layers: int, pipeline_size: int, first: Optional[int], last: Optional[int]
) -> List[int]:
    if first is None and last is None:
        if num_layers % pipeline_size:
            raise ConfigError(
                f"--num-layers ({num_layers}) is not divisible by "
                f"--pipeline-model-parallel-size ({pipeline_size}); use a multiple of "
                f"{pipeline_size} layers, or give --decoder-first-pipeline-num-layers / "
                "--decoder-last-pipeline-num-layers for an uneven split"
            )
        return [num_layers // pipeline_size] * pipeline_size
    for flag, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            raise ConfigError(f"--decoder-{flag}-pipeline-num-layers must be >= 1, got {value}")
    fixed = [first, last] if pipeline_size > 1 else [first]
    middle_stages = pipeline_size - sum(v is not None for v in fixed)
    remaining = num_layers - sum(v for v in fixed if v is not None)
    if remaining < middle_stages or (
        middle_stages and remaining % middle_stages
    ) or (middle_stages == 0 and remaining != 0):
        raise ConfigError(
            f"--num-layers ({num_layers}) minus --decoder-first-pipeline-num-layers "
            f"({first}) and --decoder-last-pipeline-num-layers ({last}) leaves {remaining} "
            f"layers, which must split evenly (at least one each) over the other "
            f"{middle_stages} of the {pipeline_size} pipeline stages"
        )
    per_middle = remaining // middle_stages if middle_stages else 0
    counts = [per_middle] * pipeline_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def pipeline_layer_layout(
    num_layers: int,
    pipeline_size: int,
    virtual_size: Optional[int] = None,
    layers_per_virtual_stage: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    account_for_embedding: bool = False,
    account_for_loss: bool = False,
) -> List[List[tuple]]:
    """(layer_offset, num_layers) of every chunk of every rank: layout[pp_rank][chunk].
    `account_for_embedding` / `account_for_loss` (Megatron's --account-for-*-in-pipeline-
    split): the split counts the embedding (the loss) as a layer, which the first chunk of
    the first rank (the last chunk of the last) then holds instead of a transformer layer.

    Raises ConfigError, naming the flags, for a split that cannot work. Pure: every rank
    computes the same layout and fails the same way.
    """
    extra = int(account_for_embedding) + int(account_for_loss)
    if extra and (first_stage_layers is not None or last_stage_layers is not None):
        raise ConfigError(
            "--decoder-first/last-pipeline-num-layers do not combine with "
            "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split "
            "(as in Megatron-LM): give one way of splitting")
    slots = num_layers + extra
    if extra and slots % pipeline_size:
        raise ConfigError(
            f"--num-layers ({num_layers}) plus the embedding / loss counted by "
            f"--account-for-*-in-pipeline-split ({extra}) must be divisible by "
            f"--pipeline-model-parallel-size ({pipeline_size})")
    virtual = _virtual_size(slots, pipeline_size, virtual_size, layers_per_virtual_stage)
    per_stage = _layers_per_stage(slots, pipeline_size, first_stage_layers, last_stage_layers)
    for rank, count in enumerate(per_stage):
        if count % virtual:
            raise ConfigError(
                f"pipeline stage {rank} holds {count} layers, which do not split into "
                f"{virtual} virtual stages (--virtual-pipeline-model-parallel-size / "
                "--num-layers-per-virtual-pipeline-stage); every stage's layer count must "
                "be a multiple of the number of virtual stages"
            )
    layout: List[List[tuple]] = [[] for _ in range(pipeline_size)]
    offset = 0
    for chunk in range(virtual):  # virtual stage chunk * pp + rank, in layer order
        for rank in range(pipeline_size):
            count = per_stage[rank] // virtual
            if account_for_embedding and rank == 0 and chunk == 0:
                count -= 1
            if account_for_loss and rank == pipeline_size - 1 and chunk == virtual - 1:
                count -= 1
            layout[rank].append((offset, count))
            offset += count
    return layout


def hybrid_pattern_layout(segments: List[int], pipeline_size: int, parallel) -> List[List[tuple]]:
    """The layout --hybrid-layer-pattern's `|` breaks give: segment r on pipeline stage r
    (Megatron's; more segments than stages, its virtual stages, are not built here)."""
    given = [flag for flag, value in (
        ("--decoder-first-pipeline-num-layers", parallel.decoder_first_pipeline_num_layers),
        ("--decoder-last-pipeline-num-layers", parallel.decoder_last_pipeline_num_layers),
        ("--num-layers-per-virtual-pipeline-stage", parallel.num_layers_per_virtual_pipeline_stage),
        ("--virtual-pipeline-model-parallel-size", parallel.virtual_pipeline_model_parallel_size),
    ) if value is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: the | breaks of --hybrid-layer-pattern define "
                          "the pipeline layout; drop them (or the breaks)")
    if len(segments) != pipeline_size or min(segments) < 1:
        raise ConfigError(
            f"--hybrid-layer-pattern has {len(segments)} |-separated segments of {segments} "
            f"layers for --pipeline-model-parallel-size {pipeline_size}: give one non-empty "
            "segment per stage (virtual stages from more segments are not supported yet), or "
            "no breaks for an even split")
    offsets = [sum(segments[:rank]) for rank in range(pipeline_size)]
    return [[(offsets[rank], segments[rank])] for rank in range(pipeline_size)]


def megatron_pipeline_layout(text: str, pipeline_size: int, num_layers: int,
                             mtp_num_layers: Optional[int]) -> List[List[tuple]]:
    """The layout of Megatron's --pipeline-model-parallel-layout string (its
    PipelineParallelLayerLayout): `|` separates virtual stages, stage k going to rank
    k mod pp as chunk k // pp; "E" the embedding, "t" a transformer layer, "m" an MTP layer,
    "L" the loss; "(...)*n" and "x*n" repeat, commas are cosmetic. Checked as Megatron
    checks it (E first, L last, once each, the t count is --num-layers, MTP after every t);
    the MTP layers must sit with the loss (on the last stage), where they are built here."""
    import re

    flag = "--pipeline-model-parallel-layout"
    expanded = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        expanded = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), expanded)
    stages = expanded.split("|")
    unknown = sorted(set(expanded) - set("|EtmL"))
    if unknown:
        raise ConfigError(f"{flag} {text!r}: unknown layer character(s) {unknown}; the layer "
                          "characters are E (embedding), t (transformer), m (MTP), L (loss)")
    if len(stages) % pipeline_size:
        raise ConfigError(f"{flag} {text!r} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size ({pipeline_size})")
    flat = "".join(stages)
    problems = []
    if not flat.startswith("E") or flat.count("E") != 1:
        problems.append("the embedding E must come first, once")
    if not flat.endswith("L") or flat.count("L") != 1:
        problems.append("the loss L must come last, once")
    if flat.count("t") != num_layers:
        problems.append(f"it holds {flat.count('t')} transformer layers t, not --num-layers "
                        f"({num_layers})")
    if flat.count("m") != (mtp_num_layers or 0):
        problems.append(f"it holds {flat.count('m')} MTP layers m, not --mtp-num-layers "
                        f"({mtp_num_layers or 0})")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        problems.append("transformer layers must come before the MTP layers")
    if "m" in flat and "m" in expanded[:expanded.rindex("|") + 1 if "|" in expanded else 0]:
        problems.append("the MTP layers must be in the last stage, with the loss (an MTP "
                        "stage of its own is not supported yet)")
    if problems:
        raise ConfigError(f"{flag} {text!r}: {'; '.join(problems)}")
    virtual = len(stages) // pipeline_size
    layout: List[List[tuple]] = [[] for _ in range(pipeline_size)]
    offset = 0
    for index, stage in enumerate(stages):
        count = stage.count("t")
        layout[index % pipeline_size].append((offset, count))
        offset += count
    assert all(len(chunks) == virtual for chunks in layout)
    return layout


def layout_from_configs(configs, pipeline_size: int) -> List[List[tuple]]:
    parallel = configs.parallel
    if parallel.pipeline_model_parallel_layout is not None:
        given = [flag for flag, value in (
            ("--virtual-pipeline-model-parallel-size",
             parallel.virtual_pipeline_model_parallel_size),
            ("--num-layers-per-virtual-pipeline-stage",
             parallel.num_layers_per_virtual_pipeline_stage),
            ("--decoder-first-pipeline-num-layers", parallel.decoder_first_pipeline_num_layers),
            ("--decoder-last-pipeline-num-layers", parallel.decoder_last_pipeline_num_layers),
            ("--account-for-embedding-in-pipeline-split",
             parallel.account_for_embedding_in_pipeline_split or None),
            ("--account-for-loss-in-pipeline-split",
             parallel.account_for_loss_in_pipeline_split or None),
            ("--hybrid-layer-pattern", configs.model.hybrid_stage_layer_counts()),
        ) if value is not None]
        if given:
            raise ConfigError(f"--pipeline-model-parallel-layout gives the whole split: drop "
                              f"{', '.join(given)} (as in Megatron-LM)")
        return megatron_pipeline_layout(parallel.pipeline_model_parallel_layout, pipeline_size,
                                        configs.model.num_layers, configs.model.mtp_num_layers)
    segments = configs.model.hybrid_stage_layer_counts()
    if segments is not None and pipeline_size > 1:
        return hybrid_pattern_layout(segments, pipeline_size, parallel)
    return pipeline_layer_layout(
        configs.model.num_layers,
        pipeline_size,
        virtual_size=parallel.virtual_pipeline_model_parallel_size,
        layers_per_virtual_stage=parallel.num_layers_per_virtual_pipeline_stage,
        first_stage_layers=parallel.decoder_first_pipeline_num_layers,
        last_stage_layers=parallel.decoder_last_pipeline_num_layers,
        account_for_embedding=parallel.account_for_embedding_in_pipeline_split,
        account_for_loss=parallel.account_for_loss_in_pipeline_split,
    )


def validate_pipeline_configs(configs, pipeline_size: int,
                              data_parallel_size: int) -> List[List[tuple]]:
    """Every check of a pipeline layout; pure, so `validate_configs` runs it on every rank
    before any collective. Returns the layout."""
    # Imported here: schedules imports this module.
    layout = layout_from_configs(configs, pipeline_size)
    # Raises for a schedule that contradicts the virtual stages (gpipe / 1f1b with v > 1).
    training = configs.training
    # With a batch-size ramp-up or step schedule every batch size it reaches is checked in
    # arguments (_validate_training_length); --global-batch-size alone is not the one used.
    varying = training.rampup_batch_size or training.step_batch_size_schedule
    if (schedule_name(training.pipeline_schedule, len(layout[0])) == "interleaved_1f1b"
            and not varying):
        check_virtual_microbatches(training.num_microbatches(data_parallel_size),
                                   pipeline_size, training.microbatch_group_size_per_vp_stage)
    return layout


def build_pipeline_model_chunks(
    model_provider: Callable, configs, state, **provider_kwargs
) -> List[torch.nn.Module]:
    """This rank's model chunks (one, or v with virtual stages), in virtual-stage order;
    `provider_kwargs` (e.g. device=) go to every `model_provider` call.

    Every chunk on every stage is built from the same CPU default-generator state, the one
    `model_parallel_seed` gives pipeline rank 0 (--seed): a model that draws a base seed at
    construction and derives each layer's init from it (GPTModel) then gives a layer the
    same weights on whichever stage or chunk it lands, as in the single-stage model. The
    rank's own generator state (seeded per stage, for dropout) is restored afterwards.
    """
    from megatron_smp.pipeline_parallel.timeline import PipelineTimeline

    layout = validate_pipeline_configs(configs, state.pp_size, state.dp_size)
    chunks_here = layout[state.pp_rank]
    timeline_path = configs.parallel.pipeline_timeline
    timeline = (
        PipelineTimeline(timeline_path, state.rank, state.device) if timeline_path else None
    )
    rank_rng_state = torch.random.get_rng_state()
    chunks = []
    for chunk_index, (layer_offset, num_layers) in enumerate(chunks_here):
        torch.random.default_generator.manual_seed(configs.training.seed)
        pre_process = state.is_pipeline_first_stage and chunk_index == 0
        post_process = state.is_pipeline_last_stage and chunk_index == len(chunks_here) - 1
        module = model_provider(
            configs, state, pre_process=pre_process, post_process=post_process,
            layer_offset=layer_offset, num_layers=num_layers, **provider_kwargs,
        )
        module.pipeline_stage = StageSpec(
            state=state, chunk_index=chunk_index, layer_offset=layer_offset,
            num_layers=num_layers, pre_process=pre_process, post_process=post_process,
            hidden_size=configs.model.hidden_size,
            sequence_parallel=configs.model.sequence_parallel_at(state.tp_size),
            dtype=configs.model.params_dtype, timeline=timeline,
        )
        chunks.append(module)
    torch.random.set_rng_state(rank_rng_state)
    return chunks


__all__ = [
    "StageSpec",
    "pipeline_layer_layout",
    "check_virtual_microbatches",
    "validate_pipeline_configs",
    "build_pipeline_model_chunks",
]
