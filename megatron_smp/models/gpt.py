"""GPTModel: one decoder-only model for every family (GPT-2, Llama, Mistral, GPT-NeoX).

A family is a `TransformerConfig`: learned positions or RoPE (partial for NeoX) or ALiBi,
LayerNorm or RMSNorm, GeLU or SwiGLU, multi-head or grouped-query attention, sequential or
parallel residual, tied or untied output layer.

Initialisation and pipeline stages. The tensor-parallel layers draw each weight's full master
tensor from the CPU default generator, so the weights do not depend on TP. To make them
independent of the pipeline layout too, the model first draws one base seed from the default
generator (the same on every stage), then builds each part under its own CPU seed derived
from it: the embedding (index 0), layer n (index n, global numbering) and the untied output
layer (index num_layers + 1). A stage holding layers 3-4 therefore holds exactly layers 3-4
of the single-stage model, and the last stage's copy of a tied word embedding is drawn under
the embedding's seed, so it starts equal to the first stage's table.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch

from megatron_smp.config import TransformerConfig
from megatron_smp.context_parallel import core_attention_spec, local_positions
from megatron_smp.context_parallel.split import packed_rank_indices
from megatron_smp.models.multi_token_prediction import MultiTokenPredictionBlock
from megatron_smp.parallel_state import ParallelState
from megatron_smp.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
    init_method_normal,
)
from megatron_smp.tensor_parallel.mappings import group_rank
from megatron_smp.tensor_parallel.utils import xavier_uniform
from megatron_smp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_smp.tensor_parallel.random import dropout, get_rng_tracker
from megatron_smp.transformer.attention import LayerTypeRotaryEmbeddings, RotaryEmbedding
from megatron_smp.transformer.rope import rope_scaling_of
from megatron_smp.transformer.block import TransformerBlock
from megatron_smp.transformer.hybrid import hybrid_layer_spec, linear_attention_layer_spec
from megatron_smp.transformer.layer import get_gpt_layer_spec
from megatron_smp.transformer.mla import MLASelfAttention
from megatron_smp.transformer.packed import PackedSequence
from megatron_smp.transformer.moe.moe_layer import moe_layer_spec
from megatron_smp.transformer.spec import LayerSpec, ModuleSpec
from megatron_smp.transformer.utils import derive_seed, init_rng_scope

_EMBEDDING_SEED_INDEX = 0


def get_gpt_decoder_layer_spec(config: TransformerConfig, state: ParallelState) -> LayerSpec:
    """The decoder layer this configuration and layout ask for: the dense layer, with the
    context-parallel core attention (`--cp-comm-type`) when cp > 1, and a mixture of experts
    in place of the MLP on the `--moe-layer-freq` layers of an MoE model; hybrid stacks by
    `--hybrid-layer-pattern` or `--linear-attention-freq` (transformer.hybrid). GPTModel's default,
    so the entry scripts, `smp.transform` and tests all build the same layers."""
    spec = get_gpt_layer_spec()
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(config, state)
    if config.multi_latent_attention:
        spec.submodules.self_attention = ModuleSpec(
            MLASelfAttention, submodules=spec.submodules.self_attention.submodules)
    if config.hybrid_layer_pattern is not None:  # one part per layer (transformer.hybrid)
        return hybrid_layer_spec(config, spec.submodules.self_attention)
    if config.linear_attention_freq is not None:
        return linear_attention_layer_spec(config, moe_layer_spec(config, spec))
    return moe_layer_spec(config, spec)


class LanguageModelEmbedding(torch.nn.Module):
    """Word (+ learned position) embeddings and dropout.

    forward(input_ids [b, s], position_ids [b, s] or None) -> [s, b, h], or this rank's
    sequence shard [s/tp, b, h] with sequence parallelism.
    """

    def __init__(
        self,
        config: TransformerConfig,
        state: ParallelState,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel_at(state.tp_size)
        self.tp_group = state.tp_group
        self.dropout = config.hidden_dropout
        self.add_position_embedding = config.position_embedding_type == "learned_absolute"
        # --apply-embedding-scaling (Gemma): word embeddings times sqrt(hidden).
        self.scale = math.sqrt(config.hidden_size) if config.apply_embedding_scaling else None
        # --use-mup --mup-embedding-mult: the summed embeddings times this (Megatron-LM main).
        self.mup_embedding_mult = config.mup_embedding_mult if config.use_mup else 1.0
        init_method = (xavier_uniform if config.embedding_init_is_xavier()
                       else init_method_normal(config.embedding_init_std()))
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            config=config,
            tp_group=state.tp_group,
            init_method=init_method,
            # With SP: reduce-scatter straight into this rank's sequence shard.
            reduce_scatter_embeddings=self.sequence_parallel,
            device=device,
        )
        if self.add_position_embedding:
            table = torch.empty(config.max_position_embeddings, config.hidden_size)
            init_method(table)  # drawn on the CPU, like the parallel layers' masters
            self.position_embeddings = torch.nn.Embedding(
                config.max_position_embeddings, config.hidden_size,
                dtype=config.params_dtype, device=device,
            )
            if self.position_embeddings.weight.device.type != "meta":
                with torch.no_grad():
                    self.position_embeddings.weight.copy_(table)
            # With SP each rank adds the positions of its own shard only: the (replicated)
            # table's grad is partial and must be summed over TP, like a norm weight's.
            self.position_embeddings.weight.sequence_parallel = self.sequence_parallel

    def replay_init(self, replay: Callable[[torch.nn.Module], int],
                    materialize: Callable[[torch.nn.Module], torch.nn.Module]) -> int:
        """Delayed initialisation of a meta-device build (`distributed.delayed_init`; the
        caller has seeded the generator as the constructor was): the word table first
        (`replay`, its own module), then the position table drawn with the same init method
        (`materialize` gives its params storage). Returns the elements initialised."""
        count = replay(self.word_embeddings)
        if self.add_position_embedding and self.position_embeddings.weight.is_meta:
            weight = self.position_embeddings.weight
            table = torch.empty(weight.shape)
            self.word_embeddings.init_method(table)
            materialize(self.position_embeddings)
            with torch.no_grad():
                self.position_embeddings.weight.copy_(table)
            count += weight.numel()
        return count

    def forward(
        self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids.transpose(0, 1))  # [s(/tp), b, h]
        if self.scale is not None:
            # In the activation dtype, as Gemma rounds it (sqrt(3072) is 55.5 in bf16).
            embeddings = embeddings * torch.tensor(self.scale, dtype=embeddings.dtype)
        if self.add_position_embedding:
            # Positions of this rank's rows: all of them, or its sequence shard with SP.
            shard = embeddings.shape[0]
            start = group_rank(self.tp_group) * shard if self.sequence_parallel else 0
            if position_ids is None:
                positions = torch.arange(start, start + shard, device=input_ids.device)
                embeddings = embeddings + self.position_embeddings(positions)[:, None, :]
            else:
                positions = position_ids.transpose(0, 1)[start : start + shard]
                embeddings = embeddings + self.position_embeddings(positions)
        if self.mup_embedding_mult != 1.0:
            embeddings = embeddings * self.mup_embedding_mult
        if self.training and self.dropout > 0.0:
            if self.sequence_parallel:  # each rank holds a different shard
                with get_rng_tracker().fork():
                    embeddings = dropout(embeddings, self.dropout)
            else:
                embeddings = dropout(embeddings, self.dropout)
        return embeddings


class GPTModel(torch.nn.Module):
    """Decoder-only language model, or one pipeline stage of it.

    forward(input_ids [b, s], position_ids=None, attention_mask=None, labels=None,
            document_ids=None, loss_mask=None)
      * attention_mask: bool [b, 1, s, s], True = masked; None = causal.
      * document_ids [b, s] (whole rows, also under context parallelism): packed rows, each
        run of equal ids a document attending only to itself (`transformer.packed`; the
        attention does no work across documents). Instead of attention_mask.
      * last stage, labels [b, s] given: per-token loss [b, s] (fp32);
      * last stage, no labels: logits [b, s, padded_vocab / tp] (this rank's vocab shard;
        `gather_full_logits` gives [b, s, vocab]);
      * other stages, or return_hidden_states=True: hidden states [s, b, h] ([s/tp, b, h]
        with sequence parallelism; after the final norm on the last stage).
    A stage other than the first reads its input from `set_input_tensor(t)`.
    With --mtp-num-layers the last stage also runs the multi-token-prediction layers when
    labels are given (input_ids then needed there too) and attaches their loss, over
    `loss_mask` [b, s] (default all tokens), for backward (models.multi_token_prediction).
    `transformer_layer_spec` picks each decoder layer's attention and MLP (a `ModuleSpec`, or
    a function of the global layer number); default `get_gpt_decoder_layer_spec`.

    `config` is a validated one (`validate_configs`, `smp.transform`, or
    `config.validate(state.config, seq_length)` for a config built by hand).

    With context parallelism every sequence tensor holds this rank's tokens only (`[b, s/cp]`
    inputs, see `context_parallel.split`); position_ids=None then means their global
    positions, so learned positions, RoPE and ALiBi see where each token really is.
    """

    def __init__(
        self,
        config: TransformerConfig,
        state: ParallelState,
        pre_process: bool = True,
        post_process: bool = True,
        layer_offset: int = 0,
        num_layers: Optional[int] = None,
        device: Optional[torch.device] = None,
        transformer_layer_spec: Optional[LayerSpec] = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.state = state
        self.pre_process = pre_process
        self.post_process = post_process
        self.tp_group = state.tp_group
        self.sequence_parallel = config.sequence_parallel_at(state.tp_size)
        self.share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        self.input_tensor: Optional[torch.Tensor] = None
        device = state.device if device is None else device

        # The same draw on every stage and rank: see the module docstring.
        base_seed = int(torch.randint(0, 2**62, (1,)).item())
        self.init_base_seed = base_seed

        # Multi-token prediction runs on the last stage and embeds tokens there too: that
        # stage then holds a copy of the word embedding, drawn like the first stage's.
        self.mtp_process = post_process and bool(config.mtp_num_layers)
        if pre_process or self.mtp_process:
            with init_rng_scope(derive_seed(base_seed, _EMBEDDING_SEED_INDEX)):
                self.embedding = LanguageModelEmbedding(config, state, device=device)

        self.rotary_pos_emb = None
        if config.uses_rotary_embedding():
            # Multi-latent attention rotates only its positional channels.
            rotary_dim = (config.qk_pos_emb_head_dim if config.multi_latent_attention
                          else config.kv_channels)
            self.rotary_pos_emb = RotaryEmbedding(
                rotary_dim, config.rotary_percent, config.rotary_base, device=device,
                interleaved=config.rotary_interleaved, scaling=rope_scaling_of(config),
            )
        # Gemma 3: the sliding-window layers rotate with their own base, unscaled.
        self.local_rotary_pos_emb = None
        if config.local_rotary_base is not None:
            self.local_rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, config.rotary_percent, config.local_rotary_base,
                device=device, interleaved=config.rotary_interleaved,
            )

        layer_spec = transformer_layer_spec or get_gpt_decoder_layer_spec(config, state)
        self.decoder = TransformerBlock(
            config,
            state,
            layer_offset=layer_offset,
            num_layers=num_layers,
            post_layer_norm=post_process,
            init_seed=base_seed,
            device=device,
            layer_spec=layer_spec,
        )
        self.mtp = None
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(config, state, layer_spec, init_seed=base_seed,
                                                 device=device)

        if post_process:
            tied_here = self.share_embeddings_and_output_weights and (pre_process
                                                                      or self.mtp_process)
            if tied_here:
                output_seed = None  # no weight of its own
            elif self.share_embeddings_and_output_weights:
                # Last stage's copy of the tied table: drawn like the word embedding (its
                # first draw under the embedding seed), so both copies start equal.
                output_seed = derive_seed(base_seed, _EMBEDDING_SEED_INDEX)
            else:
                output_seed = derive_seed(base_seed, config.num_layers + 1)
            with init_rng_scope(output_seed):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size,
                    config.padded_vocab_size(state.tp_size),
                    config=config,
                    tp_group=state.tp_group,
                    # Megatron-LM main: under muP an untied output layer starts as the
                    # embeddings do.
                    init_method=(
                        xavier_uniform if config.init_method_xavier_uniform and (
                            not config.use_mup or config.embedding_init_is_xavier())
                        else init_method_normal(config.embedding_init_std() if config.use_mup
                                                else config.init_method_std)),
                    bias=config.add_output_layer_bias,
                    gather_output=False,
                    skip_weight_param_allocation=tied_here,
                    true_output_size=config.vocab_size,
                    device=device,
                )

        if self.embedding_copies_on_end_stages():
            # Two copies of one word table (tied output layer, or the last stage's MTP
            # embedding): finalize_model_grads sums their grads over state.embedding_group so
            # they stay equal. The last stage's copy is also marked `shared`, which keeps it
            # out of the grad norm (counted once, on the first stage).
            copy = self.shared_embedding_or_output_weight() if (pre_process
                                                                 or post_process) else None
            if copy is not None:
                copy.shared_embedding = True
                if not pre_process:
                    copy.shared = True

    def embedding_copies_on_end_stages(self) -> bool:
        """Whether the first and last pipeline stage each hold a copy of the word table
        (the same answer on every rank)."""
        return self.state.pp_size > 1 and (self.share_embeddings_and_output_weights
                                           or bool(self.config.mtp_num_layers))

    def set_input_tensor(self, input_tensor) -> None:
        """Input of a non-first pipeline stage: hidden states [s(/tp), b, h]."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """This stage's copy of the word table: the embedding's where the stage has one
        (first stage, or the last with MTP) and it is tied or shared with MTP, else the
        output layer's weight."""
        embedding = getattr(self, "embedding", None)
        if embedding is not None and (self.share_embeddings_and_output_weights
                                      or self.config.mtp_num_layers):
            return embedding.word_embeddings.weight
        return self.output_layer.weight

    def _rotary(self, hidden_states: torch.Tensor, position_ids: Optional[torch.Tensor]):
        if self.rotary_pos_emb is None:
            return None
        seq_length = hidden_states.shape[0] * (self.state.tp_size if self.sequence_parallel else 1)
        table = self.rotary_pos_emb(seq_length, position_ids)
        if self.local_rotary_pos_emb is None:
            return table
        return LayerTypeRotaryEmbeddings(
            full=table, sliding=self.local_rotary_pos_emb(seq_length, position_ids))

    def _context_parallel_positions(self, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """Global positions [b, s/cp] of this CP rank's tokens."""
        if input_ids is not None:
            batch, local_length = input_ids.shape
            device = input_ids.device
        else:
            local_length, batch = self.input_tensor.shape[:2]
            local_length *= self.state.tp_size if self.sequence_parallel else 1
            device = self.input_tensor.device
        state = self.state
        positions = local_positions(local_length * state.cp_size, state.cp_size, state.cp_rank,
                                    device)
        return positions.expand(batch, local_length)

    def init_seed_parts(self) -> List[Tuple[torch.nn.Module, Optional[int]]]:
        """(part, CPU seed) of every randomly initialised part, in the order the constructor
        draws them: what a meta-device build replays (`distributed.delayed_init`)."""
        base = self.init_base_seed
        parts: List[Tuple[torch.nn.Module, Optional[int]]] = []
        if getattr(self, "embedding", None) is not None:
            parts.append((self.embedding, derive_seed(base, _EMBEDDING_SEED_INDEX)))
        for layer in self.decoder.layers:
            inner = getattr(layer, "_checkpoint_wrapped_module", layer)
            parts.append((inner, derive_seed(base, inner.layer_number)))
        mtp = getattr(self, "mtp", None)
        for depth, layer in enumerate(mtp.layers if mtp is not None else (), start=1):
            parts.append((layer, derive_seed(base, self.config.num_layers + 1 + depth)))
        output_layer = getattr(self, "output_layer", None)
        if output_layer is not None and output_layer.weight is not None:
            index = (_EMBEDDING_SEED_INDEX if self.share_embeddings_and_output_weights
                     else self.config.num_layers + 1)
            parts.append((output_layer, derive_seed(base, index)))
        return parts

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        return_hidden_states: bool = False,
    ) -> torch.Tensor:
        if document_ids is not None:
            if attention_mask is not None:
                raise ValueError("GPTModel.forward: give attention_mask or document_ids, not both")
            state = self.state
            rank_indices = (packed_rank_indices(document_ids, state.cp_size)
                            if state.cp_size > 1 else None)
            attention_mask = PackedSequence(document_ids, rank_indices, state.cp_rank,
                                            self.config.packed_attention)
            if position_ids is None and state.cp_size > 1:
                position_ids = attention_mask.local_indices
        if position_ids is None and self.state.cp_size > 1:
            position_ids = self._context_parallel_positions(input_ids)
        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError(
                    "GPTModel without pre_process needs set_input_tensor() before forward"
                )
            hidden_states = self.input_tensor
        rotary_pos_emb = self._rotary(hidden_states, position_ids)
        hidden_states = self.decoder(hidden_states, attention_mask, rotary_pos_emb)
        if not self.post_process or return_hidden_states:
            return hidden_states

        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        if self.mtp is not None and labels is not None:
            hidden_states = self._attach_mtp_loss(hidden_states, input_ids, position_ids,
                                                  attention_mask, rotary_pos_emb, labels,
                                                  loss_mask, weight)
        logits = self._logits(hidden_states, weight)  # [s, b, v/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self._per_token_loss(logits, labels)

    def _logits(self, hidden_states: torch.Tensor, weight) -> torch.Tensor:
        """hidden [s, b, h] -> this rank's logits [s, b, v/tp], soft-capped with
        --final-logit-softcapping (elementwise, so each vocab shard on its own)."""
        logits, _ = self.output_layer(hidden_states, weight=weight)
        return output_logits(logits, self.config)

    def _per_token_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """logits [s, b, v/tp], labels [b, s] -> fp32 [b, s]."""
        # The logits are read by nothing else: the loss may overwrite them.
        loss = vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1), self.tp_group, vocab_size=self.config.vocab_size,
            inplace=True,
        )
        return loss.transpose(0, 1).contiguous()

    def _attach_mtp_loss(self, hidden_states, input_ids, position_ids, attention_mask,
                         rotary_pos_emb, labels, loss_mask, weight):
        """Run the multi-token-prediction layers on the main output and attach their loss
        (see models.multi_token_prediction)."""
        if input_ids is None:
            raise ValueError("--mtp-num-layers: the last pipeline stage embeds the next tokens, "
                             "so its forward needs input_ids too (pretrain_gpt.forward_step "
                             "passes the batch's tokens on every stage)")
        if position_ids is None and self.embedding.add_position_embedding:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(
                input_ids.shape[0], -1)
        outputs = self.mtp(hidden_states, input_ids, position_ids, attention_mask,
                           rotary_pos_emb, self.embedding)

        def per_token_loss(output, shifted_labels):
            return self._per_token_loss(self._logits(output, weight), shifted_labels)

        return self.mtp.attach_loss(hidden_states, outputs, labels, loss_mask, per_token_loss)


def soft_cap_logits(logits: torch.Tensor, cap) -> torch.Tensor:
    """--final-logit-softcapping: cap * tanh(logits / cap), elementwise (so any vocab shard on
    its own); the logits unchanged when `cap` is None."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def output_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """The output layer's product as the model's logits: multiplied by muP's logit
    multiplier (--use-mup), then soft-capped (--final-logit-softcapping); elementwise."""
    mult = config.mup_logit_mult()
    if mult != 1.0:
        logits = logits * mult
    return soft_cap_logits(logits, config.final_logit_softcapping)


def gather_full_logits(
    logits_local: torch.Tensor, state: ParallelState, vocab_size: int
) -> torch.Tensor:
    """[b, s, padded_vocab / tp] vocab shards -> [b, s, vocab_size] (padding sliced off).
    Differentiable (backward keeps this rank's shard of the gradient)."""
    full = gather_from_tensor_model_parallel_region(logits_local, state.tp_group)
    return full[..., :vocab_size]


__all__ = ["GPTModel", "LanguageModelEmbedding", "gather_full_logits", "output_logits",
           "soft_cap_logits"]
