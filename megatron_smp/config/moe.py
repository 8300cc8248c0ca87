"""TransformerConfig's mixture-of-experts part: the checks and the MoE layer pattern
(the fields are declared with the rest in model.py)."""
from __future__ import annotations

from typing import List, Union

from megatron_smp.config.errors import ConfigError, _require
from megatron_smp.config.parallel import ParallelConfig


def parse_moe_layer_freq(text: Union[str, int, List[int]],
                         flag: str = "--moe-layer-freq") -> Union[int, List[int]]:
    """Megatron's --moe-layer-freq (and --window-attn-skip-freq, `flag`, the same type): an
    int N (every N-th layer) or a 0/1 pattern such as "([1]*3+[0]*1)*2" or "[1,0,1,0]",
    evaluated without `eval` (list displays of integers, `+` and `*` only)."""
    import ast

    if isinstance(text, (int, list)):
        return text
    source = text.strip()
    try:
        return int(source)
    except ValueError:
        pass

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(item) for item in node.elts]
            if all(type(item) is int for item in items):
                return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                return left + right
            if isinstance(node.op, ast.Mult) and (type(left) is int or type(right) is int):
                count, items = (left, right) if type(left) is int else (right, left)
                length = count if type(items) is int else count * len(items)
                if length > 100_000:  # a pattern longer than any model
                    raise ValueError
                return left * right
        raise ValueError

    try:
        pattern = value(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        pattern = None
    if not isinstance(pattern, (int, list)):
        raise ConfigError(
            f"{flag} {text!r}: give an integer N (every N-th layer) or a 0/1 "
            "list per layer such as \"([1]*3+[0]*1)*2\""
        )
    return pattern


class MoEChecks:
    """Mixed into TransformerConfig: --num-experts and the --moe-* flags."""

    def _validate_moe(self, parallel: ParallelConfig, name: dict) -> None:
        ep, tp = parallel.expert_model_parallel_size, parallel.tensor_model_parallel_size
        ep_flag = name["expert_model_parallel_size"]
        if self.num_moe_experts is None:
            _require(
                ep == 1,
                f"{ep_flag} {ep} needs a mixture-of-experts model: give --num-experts (or "
                "transform a Mixtral / Qwen2-MoE model)",
            )
            return
        experts = self.num_moe_experts
        _require(experts >= 1, f"--num-experts must be >= 1, got {experts}")
        _require(
            experts % ep == 0,
            f"--num-experts ({experts}) must be divisible by {ep_flag} ({ep})",
        )
        _require(
            1 <= self.moe_router_topk <= experts,
            f"--moe-router-topk ({self.moe_router_topk}) must be between 1 and --num-experts "
            f"({experts})",
        )
        choices = {
            "--moe-router-load-balancing-type": (
                self.moe_router_load_balancing_type,
                ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")),
            "--moe-token-dispatcher-type": (self.moe_token_dispatcher_type,
                                            ("allgather", "alltoall", "flex")),
            "--moe-flex-dispatcher-backend": (self.moe_flex_dispatcher_backend,
                                              ("deepep", "hybridep", "ncclep")),
            "--moe-token-drop-policy": (self.moe_token_drop_policy, ("probs", "position")),
        }
        for flag, (value, allowed) in choices.items():
            _require(value in allowed,
                     f"{flag} must be one of {', '.join(allowed)}; got {value!r}")
        self._check_router(experts)
        flex = self.moe_token_dispatcher_type == "flex"
        # Megatron-LM main's own refusals (TransformerConfig, MoEFlexTokenDispatcher).
        _require(
            self.moe_flex_dispatcher_backend != "ncclep" or flex,
            "--moe-flex-dispatcher-backend ncclep requires --moe-token-dispatcher-type flex",
        )
        _require(
            not (flex and self.moe_flex_dispatcher_backend in ("deepep", "ncclep")
                 and tp * ep == 1),
            f"--moe-token-dispatcher-type flex with the {self.moe_flex_dispatcher_backend} "
            "backend needs tensor x expert parallelism > 1 (as in Megatron-LM); use alltoall, "
            "or --moe-flex-dispatcher-backend hybridep",
        )
        _require(
            not (flex and self.moe_flex_dispatcher_backend == "deepep"
                 and self.moe_pad_expert_input_to_capacity),
            "--moe-token-dispatcher-type flex with the deepep backend does not support "
            "--moe-pad-expert-input-to-capacity (as in Megatron-LM)",
        )
        _require(
            not (self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff),
            "--moe-router-load-balancing-type sinkhorn balances without an auxiliary loss; "
            "drop --moe-aux-loss-coeff or use aux_loss",
        )
        _require(
            self.moe_expert_capacity_factor is None or self.moe_expert_capacity_factor > 0,
            f"--moe-expert-capacity-factor must be > 0, got {self.moe_expert_capacity_factor}",
        )
        _require(
            not self.moe_pad_expert_input_to_capacity
            or self.moe_expert_capacity_factor is not None,
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
        )
        _require(
            not (self.moe_router_load_balancing_type == "sinkhorn"
                 and self.moe_expert_capacity_factor is not None),
            "--moe-expert-capacity-factor applies to top-k routing; use "
            "--moe-router-load-balancing-type aux_loss, seq_aux_loss, global_aux_loss or none",
        )
        etp = parallel.expert_tensor_parallel_size
        _require(
            etp is None or etp <= tp,
            f"--expert-tensor-parallel-size {etp}: experts split over more ranks than the "
            f"dense layers (--tensor-model-parallel-size {tp}) are not supported yet; use at "
            f"most {tp}",
        )
        _require(
            etp is None or etp == tp or not parallel.use_torch_fsdp2,
            f"--expert-tensor-parallel-size {etp} below --tensor-model-parallel-size ({tp}) "
            "with --use-torch-fsdp2 is not supported yet (FSDP2 shards the experts over the "
            "dense layers' groups); drop one of the two",
        )
        expert_tp, expert_tp_flag = ((tp, "--tensor-model-parallel-size") if etp is None
                                     else (etp, "--expert-tensor-parallel-size"))
        _require(
            self.moe_ffn_hidden_size % expert_tp == 0,
            f"--moe-ffn-hidden-size ({self.moe_ffn_hidden_size}) must be divisible by "
            f"{expert_tp_flag} ({expert_tp})",
        )
        shared = self.moe_shared_expert_intermediate_size
        _require(
            shared is None or (shared >= 1 and shared % tp == 0),
            f"--moe-shared-expert-intermediate-size ({shared}) must be positive and divisible "
            f"by --tensor-model-parallel-size ({tp})",
        )
        _require(
            not self.moe_shared_expert_gate or shared is not None,
            "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size",
        )
        _require(
            self.moe_latent_size is None or self.moe_latent_size >= 1,
            f"--moe-latent-size must be >= 1, got {self.moe_latent_size}",
        )
        _require(
            tp == 1 or self.sequence_parallel,
            "mixture-of-experts layers with --tensor-model-parallel-size > 1 need "
            "--sequence-parallel (as in Megatron-LM)",
        )
        self.moe_layer_pattern()  # raises for a malformed or wrong-length pattern

    def _check_router(self, experts: int) -> None:
        """The DeepSeek-V3 router flags (sigmoid scores, expert bias, group-limited top-k)."""
        _require(self.moe_router_score_function in ("softmax", "sigmoid", "sqrtsoftplus"),
                 f"--moe-router-score-function must be softmax, sigmoid or sqrtsoftplus, got "
                 f"{self.moe_router_score_function!r}")
        _require(self.moe_router_dtype in (None, "fp32", "fp64"),
                 f"--moe-router-dtype must be fp32 or fp64, got {self.moe_router_dtype!r}")
        # sigmoid and sqrtsoftplus score every expert before top-k, which is what
        # --moe-router-pre-softmax asks (Megatron accepts the pair; it changes nothing there).
        sigmoid = self.moe_router_score_function in ("sigmoid", "sqrtsoftplus")
        _require(not self.moe_router_enable_expert_bias or sigmoid,
                 "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                 "or sqrtsoftplus (as in Megatron-LM)")
        _require(self.moe_router_bias_update_rate >= 0,
                 f"--moe-router-bias-update-rate must be >= 0, got "
                 f"{self.moe_router_bias_update_rate}")
        special = [flag for flag, on in (
            (f"--moe-router-score-function {self.moe_router_score_function}", sigmoid),
            ("--moe-router-num-groups", self.moe_router_num_groups is not None),
            ("--moe-router-topk-scaling-factor",
             self.moe_router_topk_scaling_factor is not None)) if on]
        _require(not (special and self.moe_router_load_balancing_type == "sinkhorn"),
                 f"{', '.join(special)} apply to top-k routing; --moe-router-load-balancing-type "
                 "sinkhorn chooses experts its own way (use aux_loss, seq_aux_loss, global_aux_loss "
                 "or none)")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        _require((groups is None) == (group_topk is None),
                 "--moe-router-num-groups and --moe-router-group-topk go together")
        if groups is not None:
            topk = self.moe_router_topk
            _require(groups >= 1 and experts % groups == 0,
                     f"--moe-router-num-groups ({groups}) must divide --num-experts ({experts})")
            _require(1 <= group_topk <= groups,
                     f"--moe-router-group-topk ({group_topk}) must be between 1 and "
                     f"--moe-router-num-groups ({groups})")
            # Each group is scored by the sum of its topk/group_topk best experts (Megatron's).
            _require(topk % group_topk == 0 and topk <= group_topk * (experts // groups),
                     f"--moe-router-topk ({topk}) must be a multiple of --moe-router-group-topk "
                     f"({group_topk}) and at most group_topk x experts per group "
                     f"({group_topk * (experts // groups)})")

    def moe_layer_pattern(self) -> List[int]:
        """1 for each (0-based) layer that is a mixture of experts, 0 for a dense one."""
        if self.num_moe_experts is None:
            return [0] * self.num_layers
        freq = parse_moe_layer_freq(self.moe_layer_freq)
        if isinstance(freq, int):
            _require(freq >= 1, f"--moe-layer-freq must be >= 1, got {freq}")
            return [1 if index % freq == 0 else 0 for index in range(self.num_layers)]
        _require(
            len(freq) == self.num_layers and set(freq) <= {0, 1},
            f"--moe-layer-freq pattern {freq} must hold one 0 or 1 per layer "
            f"(--num-layers {self.num_layers})",
        )
        return list(freq)
