"""Pretrain a Llama-family model (RoPE, RMSNorm, SwiGLU, GQA, untied output) with Megatron's flags.

The Llama architecture is the default here; every Megatron flag still overrides it, so
Llama-2/3 and Mistral shapes come from --num-query-groups, --rotary-base, --ffn-hidden-size.
"""
from megatron_smp.training import main, pretrain
from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

LLAMA_DEFAULTS = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "untie_embeddings_and_output_weights": True,
    "disable_bias_linear": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "tokenizer_type": "SentencePieceTokenizer",
}

if __name__ == "__main__":
    main(lambda: pretrain(
        train_valid_test_datasets_provider, model_provider, forward_step,
        args_defaults=LLAMA_DEFAULTS,
    ))
