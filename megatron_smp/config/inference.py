"""InferenceConfig: the inference engine's sizes and options (the --inference-* flags and
speculative decoding's), for `inference.launcher` (tools/generate.py and the server, through
`training.inference_flags`) and the rollouts of `train_rl.py`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_smp.config.errors import ConfigError


@dataclass
class InferenceConfig:
    max_tokens: int = 16384  # --inference-max-tokens: the paged KV cache's tokens
    max_requests: int = 64  # --inference-max-requests: the running batch
    # --inference-max-seq-length: longest prompt + generation (None: --max-position-embeddings)
    max_seq_length: Optional[int] = None
    block_size: int = 16  # --inference-dynamic-batching-block-size: tokens per KV cache block
    # --inference-dynamic-batching-max-tokens: tokens one step runs (None: no limit)
    max_step_tokens: Optional[int] = None
    chunked_prefill: bool = False  # --enable-chunked-prefill
    prefix_caching: bool = False  # --inference-dynamic-batching-prefix-caching
    # --inference-dynamic-batching-prefix-caching-eviction-policy (None: ref_zero with prefix
    # caching; see `eviction_policy`).
    prefix_caching_eviction_policy: Optional[str] = None
    speculative_config: Optional[str] = None  # --speculative-config: vLLM's JSON
    num_speculative_tokens: Optional[int] = None  # --num-speculative-tokens: MTP drafts
    # The decode-only steps at padded shapes: "cuda_graph" (--cuda-graph-impl local),
    # "compile" (--inference-torch-compile) or None (eager).
    decode_step: Optional[str] = None
    num_cuda_graphs: int = 16  # --inference-dynamic-batching-num-cuda-graphs: batch sizes
    # --inference-dynamic-batching-cuda-graph-sizing-distribution: exponential | linear
    cuda_graph_sizing_distribution: str = "exponential"
    cuda_graph_warmup_steps: int = 3  # --cuda-graph-warmup-steps: eager runs before a capture

    def validate(self) -> None:
        """ConfigError naming the flag (the engine's own sizes and options)."""
        for flag, value in (("--inference-max-tokens", self.max_tokens),
                            ("--inference-max-requests", self.max_requests),
                            ("--inference-dynamic-batching-block-size", self.block_size)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1")
        if self.num_cuda_graphs == 0 or self.num_cuda_graphs < -1:
            raise ConfigError("--inference-dynamic-batching-num-cuda-graphs must be >= 1, or "
                              "-1 (every batch size the sizing distribution gives)")
        if self.cuda_graph_warmup_steps < 0:
            raise ConfigError("--cuda-graph-warmup-steps must be >= 0")

    @property
    def eviction_policy(self) -> Optional[str]:
        """The prefix cache's eviction policy: None without prefix caching, else the flag's
        (ref_zero by default)."""
        if not self.prefix_caching:
            return None
        return self.prefix_caching_eviction_policy or "ref_zero"
