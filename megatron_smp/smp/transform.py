"""`megatron_smp.smp.transform` (torch.sagemaker.transform): an HF causal LM into the
framework's tensor/context/expert-parallel implementation.

This module is callable: `tsm.transform(model)` calls `transform` below, while
`from megatron_smp.smp.transform import TransformedModel` imports from it, whichever happens
first (an attribute `transform` on the package would otherwise be replaced by the submodule
the first time it is imported).
"""
from __future__ import annotations

import sys
import types
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from megatron_smp.config import ConfigError, TransformerConfig
from megatron_smp.checkpointing.engine.agreement import collective_device
from megatron_smp.smp.moe.moe_config import MoEConfig
from megatron_smp.smp.state import init, is_initialized, state


class TransformedModel(torch.nn.Module):
    """What `transform` returns: the framework's tensor/context/expert-parallel `GPTModel`
    (`.module`) behind the Hugging Face causal LM's contract (see `smp.hf_contract`).

    forward(input_ids [b, s], attention_mask=None, position_ids=None, labels=None,
            return_dict=None, *, shift_labels=None, num_items_in_batch=None,
            return_logits=None, use_cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
            max_length_q=None, max_length_k=None, seq_idx=None)
      * attention_mask: HF's [b, s] padding mask (1 = token, 0 = padding), or a 4-D mask as
        HF takes one ([b, 1, s, s], bool True = attend, or additive float 0 / -inf); None =
        causal.
      * Padding-free batches (several documents in a row, each attending only to itself), as
        HF decides them (`hf_contract.packed_document_ids`): position_ids that restart, with
        no attention_mask and use_cache False (the call's, else config.use_cache); or flash
        attention's cu_seq_lens_q/k + max_length_q/k, or seq_idx (what
        `DataCollatorWithFlattening` and TRL's padding-free collator send). They run on the
        packed attention path (`transformer.packed`) at every layout; under context
        parallelism with cp_comm_type "all_gather", split per document where the lengths
        allow (`packed_rank_indices`). Boundaries that disagree are a ConfigError.
      * labels: HF's, unshifted, -100 = ignored; the loss is HF's (shift by one, mean over
        the scored positions, or sum / `num_items_in_batch`). `shift_labels`: already
        shifted targets instead (as HF takes them).
      * returns HF's `CausalLMOutputWithPast` (`MoeCausalLMOutputWithPast` for MoE models):
        `.loss`, `.logits`, `out["loss"]`; return_dict=False gives HF's tuple.
      * The loss is the whole sequence's on every rank of the TP/CP/EP groups (the
        vocab-parallel cross entropy, then the per-token losses gathered over CP); each
        data-parallel rank's is its own batch's, as with HF under FSDP.
      * Logits: without labels, the full [b, s, vocab] (gathered over TP and CP, padding
        columns sliced off). With labels they are not formed (`.logits` is None: gathering
        the vocabulary costs memory the loss does not need) unless `return_logits=True`.
      * `generate(...)`: Hugging Face's generate with a KV cache (see its docstring).
      * Keywords it cannot honour (past_key_values / cache, use_cache=True, inputs_embeds,
        output_attentions=True, output_hidden_states=True, output_router_logits=True or
        config.output_router_logits, ...) are a ConfigError naming them.
    `base_model(...)` (the backbone: `BaseModelOutputWithPast` of the final norm's output
    [b, s, h]), `get_output_embeddings()` (the full LM head weight) and `add_model_tags` are
    HF's, for TRL's fused LM head.
    `config` is the HF model's config, `generation_config` its generation config,
    `transformer_config` ours; `hf_state_dict()` gives HF's state dict back (collective over
    the TP and EP groups).
    """

    def __init__(self, module: torch.nn.Module, family: str, hf_config=None,
                 generation_config=None) -> None:
        super().__init__()
        self.module = module
        self.family = family
        self.transformer_config: TransformerConfig = module.config
        self.config = hf_config if hf_config is not None else module.config
        self.generation_config = generation_config

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        return_dict: Optional[bool] = None,
        *,
        shift_labels: Optional[torch.Tensor] = None,
        num_items_in_batch: Optional[Any] = None,
        return_logits: Optional[bool] = None,
        **keywords: Any,
    ):
        from megatron_smp.models.gpt import gather_full_logits
        from megatron_smp.smp import hf_contract
        from megatron_smp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        targets = keep = None
        if shift_labels is None and labels is not None:
            shift_labels = hf_contract.shift_labels(labels)
        if shift_labels is not None:
            targets, keep = hf_contract.targets_and_keep(shift_labels)
        batch = self._prepare_batch(input_ids, attention_mask, position_ids, keywords,
                                    targets=targets)
        parallel_state = self.module.state
        local_logits = self.module(batch["tokens"], position_ids=batch["position_ids"],
                                   attention_mask=batch["attention_mask"],
                                   document_ids=batch["document_ids"])  # [b, s/cp, v/tp]
        loss = None
        if targets is not None:
            per_token = vocab_parallel_cross_entropy(
                local_logits, batch["targets"], parallel_state.tp_group,
                vocab_size=self.transformer_config.vocab_size,
            )
            per_token = self._gather_sequence(per_token, batch)
            loss = hf_contract.causal_lm_loss(per_token, keep, num_items_in_batch)
        logits = None
        if targets is None or return_logits:
            logits = gather_full_logits(self._gather_sequence(local_logits, batch),
                                        parallel_state, self.transformer_config.vocab_size)
        moe = self.transformer_config.num_moe_experts is not None
        return hf_contract.causal_lm_output(loss, logits, return_dict, moe)

    def _prepare_batch(self, input_ids, attention_mask, position_ids, keywords,
                       **sequences) -> Dict[str, Any]:
        """HF's forward keywords -> this rank's inputs of `GPTModel`: "tokens", "position_ids",
        "attention_mask" (ours), "document_ids" (padding-free rows, `hf_contract.
        packed_document_ids`, from position_ids or the `keywords` of PACKING_KEYWORDS),
        "rank_indices" (packed rows under CP) and `sequences` ([b, s] tensors such as
        targets), split over context parallelism. The other `keywords` are checked
        (`check_forward_keywords`). Every check runs before any collective."""
        from megatron_smp.models.hf import get_adapter
        from megatron_smp.smp import hf_contract

        keywords = dict(keywords)
        packing = {name: keywords.pop(name, None) for name in hf_contract.PACKING_KEYWORDS}
        use_cache = keywords.get("use_cache")
        hf_contract.check_forward_keywords(keywords, self.config)
        if input_ids is None:
            raise ConfigError("transformed model forward: input_ids is required")
        if input_ids.dim() != 2:
            raise ConfigError(f"transformed model forward: input_ids must be [batch, seq], got "
                              f"{tuple(input_ids.shape)}")
        use_cache = hf_contract.resolve_config_default("use_cache", use_cache, self.config)
        if self.is_activation_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False  # HF turns the cache off under gradient checkpointing
        mask = hf_contract.padding_to_attention_mask(attention_mask, input_ids.shape[1])
        document_ids = hf_contract.packed_document_ids(
            input_ids.shape, attention_mask, position_ids, use_cache, **packing,
            masks_read_position_ids=getattr(get_adapter(self.family),
                                            "HF_MASKS_READ_POSITION_IDS", True),
            attn_implementation=getattr(self.config, "_attn_implementation", None))
        if position_ids is not None and position_ids.dim() <= 2:
            position_ids = position_ids.expand(input_ids.shape)  # HF broadcasts [s], [1, s]
        parallel_state = self.module.state
        batch = {"tokens": input_ids, "position_ids": position_ids, "attention_mask": mask,
                 "document_ids": document_ids, **sequences}
        if parallel_state.cp_size == 1:
            return dict(batch, rank_indices=None)
        # This rank's share of the sequence in, the whole sequence's outputs back.
        from megatron_smp.context_parallel import get_batch_on_this_cp_rank
        from megatron_smp.context_parallel.split import packed_rank_indices

        rank_indices = None
        if document_ids is not None:
            self._check_packed_context_parallel(input_ids.shape[1])
            rank_indices = packed_rank_indices(document_ids, parallel_state.cp_size)
        batch = get_batch_on_this_cp_rank(batch, parallel_state.cp_size, parallel_state.cp_rank)
        return dict(batch, rank_indices=rank_indices)

    def _check_packed_context_parallel(self, seq_length: int) -> None:
        """ConfigError for a padding-free batch under a context-parallel layout that cannot
        keep its documents apart (the same rules as --sft's)."""
        from megatron_smp.context_parallel.split import check_divisible

        config = self.transformer_config
        check_divisible(seq_length, self.module.state.cp_size)
        if config.cp_comm_type != "all_gather":
            raise ConfigError(
                f"transformed model forward: a padding-free batch (documents packed in a row) "
                f"under context parallelism needs cp_comm_type 'all_gather' (each rank's "
                f"queries attend to their document's gathered keys), got "
                f"{config.cp_comm_type!r}; pass transform(..., cp_comm_type='all_gather')")
        windowed = any((config.layer_window_size(n) or (-1,))[0] >= 0
                       for n in range(1, config.num_layers + 1))
        features = [name for name, on in (
            ("sliding windows", windowed), ("attention sinks", config.softmax_type != "vanilla"),
            ("ALiBi", config.position_embedding_type == "alibi")) if on]
        if features:
            raise ConfigError(
                f"transformed model forward: a padding-free batch under context parallelism "
                f"attends without {', '.join(features)}, which this model has; use "
                "context_parallel_degree 1 for it, or pad the documents into rows of their own")

    def _gather_sequence(self, tensor: torch.Tensor, batch: Dict[str, Any]) -> torch.Tensor:
        """[b, s/cp, ...] of this CP rank -> [b, s, ...] of the whole rows (differentiable)."""
        parallel_state = self.module.state
        if parallel_state.cp_size == 1:
            return tensor
        from megatron_smp.context_parallel import gather_from_context_parallel

        return gather_from_context_parallel(tensor, parallel_state.cp_group,
                                            batch["rank_indices"])

    def hidden_states(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        **keywords: Any,
    ) -> torch.Tensor:
        """The backbone's output, after the final norm: [b, s, h], whole rows on every rank
        (gathered over SP and CP; backward keeps this rank's share, the consumer being
        replicated over the TP and CP groups). The same keywords and checks as `forward`."""
        from megatron_smp.tensor_parallel.mappings import gather_from_sequence_parallel_region

        batch = self._prepare_batch(input_ids, attention_mask, position_ids, keywords)
        hidden = self.module(batch["tokens"], position_ids=batch["position_ids"],
                             attention_mask=batch["attention_mask"],
                             document_ids=batch["document_ids"], return_hidden_states=True)
        if self.module.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.module.state.tp_group,
                                                          tensor_parallel_output_grad=False)
        return self._gather_sequence(hidden.transpose(0, 1), batch)

    @property
    def base_model(self) -> "_Backbone":
        """HF's `base_model`: the backbone, called like HF's (`model.model(...)`), returning
        `BaseModelOutputWithPast(last_hidden_state=[b, s, h])` (what TRL's fused LM head
        runs)."""
        return _Backbone(self)

    def get_output_embeddings(self) -> "_FullOutputLayer":
        """HF's LM head, read-only: `.weight` [vocab, h] (gathered over TP, vocabulary padding
        cut off; backward keeps this rank's rows, and 1 / cp of their grad under CP, where every
        rank forms the whole loss) and `.bias` (None, or [vocab]). Rebuilt on each call, so a
        caller reads it per forward (as TRL's fused LM head does)."""
        return _FullOutputLayer(self)

    supports_gradient_checkpointing = True

    @property
    def is_activation_checkpointing(self) -> bool:
        """HF's flag: whether `activation_checkpointing_enable` turned layer recompute on."""
        return self.module.decoder.recompute_granularity == "full"

    is_gradient_checkpointing = is_activation_checkpointing  # HF's older name

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """HF's activation checkpointing (what HF's Trainer and TRL call with
        `gradient_checkpointing=True`): every decoder layer recomputed in backward, our
        `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`.
        `use_reentrant` picks torch's mechanism, which has no counterpart here (one recompute,
        the same numbers either way); other kwargs, every_n_layers > 1 and offload are a
        ConfigError."""
        unknown = sorted(set(activation_checkpointing_kwargs or {}) - {"use_reentrant"})
        if every_n_layers != 1:
            unknown.append(f"every_n_layers={every_n_layers}")
        if offload:
            unknown.append("offload=True")
        if unknown:
            raise ConfigError(
                f"transformed model activation_checkpointing_enable: {', '.join(unknown)} not "
                "supported; it recomputes every layer (use_reentrant alone is taken; for "
                "offloading see sm_activation_offloading)")
        decoder = self.module.decoder
        if not self.is_activation_checkpointing:
            self._recompute_before = (decoder.recompute_granularity, decoder.recompute_method,
                                      decoder.recompute_num_layers)
        decoder.recompute_granularity, decoder.recompute_method = "full", "uniform"
        decoder.recompute_num_layers = 1

    def activation_checkpointing_disable(self) -> None:
        """Back to the recompute the model was built with."""
        before = getattr(self, "_recompute_before", None)
        if before is not None:
            decoder = self.module.decoder
            (decoder.recompute_granularity, decoder.recompute_method,
             decoder.recompute_num_layers) = before
            self._recompute_before = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None,
                                      **kwargs) -> None:
        """HF's older name of `activation_checkpointing_enable`."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    gradient_checkpointing_disable = activation_checkpointing_disable  # HF's older name

    model_tags: Optional[list] = None

    def add_model_tags(self, tags) -> None:
        """HF's `add_model_tags`: the tags HF writes into a model card, kept in `model_tags`
        as HF keeps them (TRL's trainers add theirs), for whoever saves the HF model."""
        tags = [tags] if isinstance(tags, str) else list(tags)
        self.model_tags = list(dict.fromkeys((self.model_tags or []) + tags))

    def generate(self, inputs: Optional[torch.Tensor] = None, generation_config=None,
                 attention_mask: Optional[torch.Tensor] = None, *,
                 input_ids: Optional[torch.Tensor] = None, **kwargs):
        """Hugging Face's `generate` (greedy or sampled, HF's keywords and GenerationConfig,
        left-padded attention_mask) on the inference engine's KV cache
        (`megatron_smp.inference.hf_generate`): input ids [b, s] -> [b, s + new] tokens.
        Collective over the model's ranks (every rank passes the same inputs)."""
        from megatron_smp.inference.hf_generate import generate, resolve_generation_config

        if inputs is not None and input_ids is not None:
            raise ConfigError("generate: give inputs or input_ids, not both")
        input_ids = inputs if inputs is not None else input_ids
        if input_ids is None:
            raise ConfigError("generate: input_ids is required")
        settings = resolve_generation_config(self, generation_config, **kwargs)
        parallel_state = self.module.state
        # Expert parallelism exchanges tokens over data-parallel ranks too: run the whole
        # world as one model then.
        group = parallel_state.model_parallel_group if parallel_state.ep_size == 1 else None
        return generate(self.module, input_ids, attention_mask, settings, group)

    def _full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Our full (TP=1) state dict, LoRA adapters included: this rank's TP (and EP)
        shards gathered and merged. Collective over the TP and EP groups."""
        from megatron_smp.models.sharding import (
            expert_parallel_merge, merge_state_dicts, tensor_parallel_layout,
        )

        parallel_state = self.module.state
        config = self.transformer_config
        local = {name: tensor.detach().cpu() for name, tensor in self.module.state_dict().items()
                 if not name.endswith("_extra_state")}
        full = local
        if parallel_state.tp_size > 1:
            shards = [None] * parallel_state.tp_size
            dist.all_gather_object(shards, local, group=parallel_state.tp_group)
            full = merge_state_dicts(shards, config, tensor_parallel_layout(self.module))
        if config.num_moe_experts is not None and parallel_state.ep_size > 1:
            shards = [None] * parallel_state.ep_size
            dist.all_gather_object(shards, full, group=parallel_state.ep_group)
            full = expert_parallel_merge(shards, config.num_moe_experts)
        return full

    def hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """HF's full state dict of the current weights, on every rank: this rank's TP (and EP)
        shards gathered and merged, LoRA adapters (`apply_lora`) merged into their base
        weights, then the family adapter's `to_hf`. Collective over the TP and EP groups;
        call it before FSDP shards the model (or on the unsharded model)."""
        from megatron_smp.models.hf import get_adapter
        from megatron_smp.tensor_parallel.lora import merge_lora

        full = self._full_state_dict()
        if self.lora is not None:
            full = merge_lora(full, self.lora["alpha"], self.lora["rank"])
        return get_adapter(self.family).to_hf(full, self.transformer_config)

    lora: Optional[Dict[str, Any]] = None

    def apply_lora(self, rank: int = 8, alpha: float = 32.0, dropout: float = 0.0,
                   target_modules=None):
        """LoRA in one call: adapters on the target layers (Megatron-Bridge's names, default
        all of linear_qkv, linear_proj, linear_fc1, linear_fc2), split like their layers under
        TP, the rest frozen; build the optimizer over `parameters()` afterwards (only the
        adapters require grad). Returns the adapted layers' names. `hf_state_dict()` then
        gives the merged model, `save_peft_adapter(dir)` the PEFT adapter directory."""
        from megatron_smp.tensor_parallel.lora import LORA_TARGETS, apply_lora

        if self.lora is not None:
            raise ConfigError("apply_lora: this model already has LoRA adapters")
        targets = list(target_modules or LORA_TARGETS)
        adapted = apply_lora(self.module, rank, alpha, dropout, targets)
        self.lora = {"rank": rank, "alpha": alpha, "dropout": dropout, "targets": targets}
        return adapted

    def save_peft_adapter(self, directory: str, base_model_name_or_path: str = None) -> None:
        """Write the adapters as a PEFT adapter directory that `peft.PeftModel.from_pretrained`
        loads onto the HF model (dense Llama family). Collective like `hf_state_dict`; rank 0
        writes."""
        from megatron_smp.models.hf.peft import save_peft_adapter

        if self.lora is None:
            raise ConfigError("save_peft_adapter: call apply_lora first (the model has no "
                              "LoRA adapters)")
        full = self._full_state_dict()
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        save_peft_adapter(directory, full, self.transformer_config, self.lora["rank"],
                          self.lora["alpha"], self.lora["dropout"], self.lora["targets"],
                          base_model_name_or_path)


class _Backbone:
    """`TransformedModel.base_model`: the backbone behind HF's call and output."""

    def __init__(self, model: TransformedModel) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.model.hidden_states(*args,
                                                                                   **kwargs))


class _FullOutputLayer:
    """`TransformedModel.get_output_embeddings()`: the output layer's full weight and bias."""

    def __init__(self, model: TransformedModel) -> None:
        module = model.module
        self._model = model
        self._layer = module.output_layer
        self._tied = module.output_layer.weight is None

    def _full(self, shard: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        from megatron_smp.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if shard is None:
            return None
        state = self._model.module.state
        full = gather_from_sequence_parallel_region(shard, state.tp_group,
                                                    tensor_parallel_output_grad=False)
        full = full[: self._model.transformer_config.vocab_size]
        if state.cp_size > 1:
            # Every CP rank forms the whole loss from this weight: 1 / cp of its grad on each
            # makes the CP ranks' grads add up to the whole one, as the backbone's do.
            full.register_hook(lambda grad: grad / state.cp_size)
        return full

    @property
    def weight(self) -> torch.Tensor:
        module = self._model.module
        shard = module.embedding.word_embeddings.weight if self._tied else self._layer.weight
        return self._full(shard)

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self._full(getattr(self._layer, "bias", None))


def _has_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _broadcast_state_dict(full: Optional[Dict[str, torch.Tensor]], src: int, group,
                          device: torch.device) -> Dict[str, torch.Tensor]:
    """Broadcast a state dict from global rank `src` over `group` (metadata, then tensors)."""
    meta = [None]
    if dist.get_rank() == src:
        meta = [[(name, tuple(t.shape), t.dtype) for name, t in full.items()]]
    dist.broadcast_object_list(meta, src=src, group=group)
    out = {}
    for name, shape, dtype in meta[0]:
        if dist.get_rank() == src:
            tensor = full[name].to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        out[name] = tensor.cpu()
    return out


def transform(
    model: torch.nn.Module,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
    config: Union[None, Dict[str, Any], MoEConfig] = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: Optional[str] = None,
) -> TransformedModel:
    """Convert an HF GPT2LMHeadModel / LlamaForCausalLM / MistralForCausalLM /
    GPTNeoXForCausalLM into the framework's tensor-parallel implementation.

    * The weights are the HF model's, sharded over `smp.state.tp_process_group`. With
      `load_state_dict_from_rank0`, rank 0's weights are broadcast over rank 0's TP group
      (other ranks' HF models may be random or on the meta device); other TP groups load
      their own HF model's weights, or keep a fresh init when those are on the meta device.
    * `config`: TransformerConfig fields to override (e.g. {"sequence_parallel": True}), or
      for a Mixtral / Qwen2-MoE model an SMP `MoEConfig`. MoE models are split over
      `expert_parallel_degree` (each rank holds E / ep experts) as well as TP; at TP > 1
      they run with sequence parallelism (the only MoE layout at TP > 1) unless the config
      says otherwise (then a ConfigError).
    * The model trains under torch's own FullyShardedDataParallel / fully_shard (after
      `init`, see `smp.torch_fsdp`) as well as under our DDP / `smp.fully_shard`, at any
      TP and EP: it carries the TP sums and expert scaling torch's FSDP lacks
      (`smp.fsdp_grads`).
    * `dtype` / `device`: of the new model (default: the HF model's dtype, `state.device`).
    * `cp_comm_type`: context parallelism's attention ("p2p", "all_gather", "a2a"; default
      the `init` key). With context_parallel_degree > 1 the model takes and returns whole
      sequences; inside, each rank of the CP group runs its share (chunks i and 2N-1-i), and
      the parameters' grads of the CP ranks add up to the whole-sequence grads.
    """
    from megatron_smp.models.gpt import GPTModel
    from megatron_smp.models.hf import family_of, get_adapter
    from megatron_smp.models.sharding import expert_parallel_shard, shard_state_dict
    from megatron_smp.transformer.utils import init_rng_scope

    if not is_initialized():
        init()
    parallel_state = state.parallel_state
    if parallel_state.pp_size > 1:
        raise ConfigError(
            "transform supports tensor, context (and data) parallelism; "
            "pipeline_parallel_degree must be 1 here"
        )
    adapter = get_adapter(model)
    family = family_of(model)
    transformer_config = adapter.config_from_hf(model.config)
    moe_config = config if isinstance(config, MoEConfig) else None
    if moe_config is not None:
        if transformer_config.num_moe_experts is None:
            raise ConfigError(
                f"transform(config=MoEConfig(...)): {type(model).__name__} has no experts; "
                "pass a dict of TransformerConfig overrides for a dense model"
            )
        config = moe_config.transformer_overrides()
    overrides = dict(config or {})
    unknown = sorted(k for k in overrides if not hasattr(transformer_config, k))
    if unknown:
        raise ConfigError(f"transform: unknown transformer config key(s) {unknown}")
    if dtype is None:
        source = next(model.parameters(), None)
        dtype = source.dtype if source is not None and source.is_floating_point() else torch.float32
    overrides.setdefault("cp_comm_type", cp_comm_type or state.config.get("cp_comm_type", "p2p"))
    if "sequence_parallel" in state.config.get("v1", {}):  # v1's optimize: memory | speed
        overrides.setdefault("sequence_parallel",
                             state.config["v1"]["sequence_parallel"] and parallel_state.tp_size > 1)
    if (transformer_config.num_moe_experts is not None and parallel_state.tp_size > 1
            and "sequence_parallel" not in overrides):
        # Our MoE layers run on sequence shards at TP > 1 (Megatron's rule): the only
        # layout there is, so an SMP script's tensor_parallel_degree alone selects it.
        overrides["sequence_parallel"] = True
    overrides.setdefault("params_dtype", dtype)
    overrides.setdefault("bf16", dtype == torch.bfloat16)
    overrides.setdefault("fp16", dtype == torch.float16)
    transformer_config = transformer_config.replace(**overrides)
    # The model's one check against the layout (GPTModel takes a validated config).
    transformer_config.validate(parallel_state.config)
    device = torch.device(device) if device is not None else parallel_state.device
    outside_rank0_tp_group = 0 not in parallel_state.group_ranks["tp"]
    if _has_meta(model) and (not load_state_dict_from_rank0 or outside_rank0_tp_group):
        # Delayed initialisation: the transformed model stays on the meta device too, and
        # DelayedParamIniter materialises it shard by shard (see smp.fully_shard); with
        # load_state_dict_from_rank0, fully_shard(sync_module_states=True) then gives these
        # ranks rank 0's TP group's weights.
        device = torch.device("meta")

    seed = moe_config.random_seed if moe_config is not None else None
    if moe_config is not None:
        # SMP: the seed of the random ops in expert-parallel modules, made unique per EP (and
        # TP) rank; the fresh initialisation below draws from it too.
        from megatron_smp.tensor_parallel.random import (
            EXPERT_PARALLEL_RNG, expert_parallel_stream_seed, get_rng_tracker,
        )

        get_rng_tracker().reseed(EXPERT_PARALLEL_RNG,
                                 expert_parallel_stream_seed(seed, parallel_state))
    with init_rng_scope(seed):
        module = GPTModel(transformer_config, parallel_state, device=device)
    module.train(model.training)

    full = None
    if load_state_dict_from_rank0:
        tp_ranks = parallel_state.group_ranks["tp"]
        if 0 in tp_ranks:
            if state.rank == 0:
                if _has_meta(model):
                    raise ConfigError(
                        "transform(load_state_dict_from_rank0=True): rank 0's model has "
                        "parameters on the meta device; rank 0 must hold real weights"
                    )
                full = adapter.from_hf(model.state_dict(), transformer_config)
            full = _broadcast_state_dict(
                full, 0, parallel_state.tp_group, collective_device(parallel_state.tp_group)
            )
        elif not _has_meta(model):
            full = adapter.from_hf(model.state_dict(), transformer_config)
    elif not _has_meta(model):
        full = adapter.from_hf(model.state_dict(), transformer_config)

    if full is not None:
        shard = shard_state_dict(
            full, transformer_config, parallel_state.tp_size, parallel_state.tp_rank
        )
        if transformer_config.num_moe_experts is not None:
            shard = expert_parallel_shard(shard, transformer_config.num_moe_experts,
                                          parallel_state.ep_size, parallel_state.ep_rank)
        module.load_state_dict(shard, strict=True)

    transformed = TransformedModel(module, family, model.config,
                                   getattr(model, "generation_config", None))
    transformed.loaded_from_rank0 = load_state_dict_from_rank0
    # What torch's own FSDP needs at TP > 1 with sequence parallelism and at EP > 1 (idle
    # until FullyShardedDataParallel / fully_shard wraps the model): see smp.fsdp_grads.
    from megatron_smp.smp.fsdp_grads import TorchFSDPGrads

    transformed.torch_fsdp_grads = TorchFSDPGrads(module, parallel_state)
    return transformed


class _CallableModule(types.ModuleType):
    """The module type of this file: calling the module calls `transform`."""

    def __call__(self, *args, **kwargs):
        return self.transform(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
