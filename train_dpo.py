"""Direct Preference Optimization with Megatron's flags, TRL's loss types and metric names.

    python tools/preprocess_sft_data.py --preference --input pairs.jsonl \
        --output-prefix data/pairs --tokenizer-model hf_dir --seq-length 1024
    torchrun --nproc-per-node 2 train_dpo.py --data-path data/pairs_text_document \
        --split 95,5,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf_dir \
        --seq-length 1024 --load sft_ckpt --finetune --save dpo_ckpt \
        --dpo-beta 0.1 --dpo-loss-type sigmoid [--dpo-rpo-alpha 1.0] \
        [--dpo-reference precomputed|frozen|adapters-off] [--lora-rank 16 ...]

The model flags are pretrain_gpt.py's (give the Llama ones, or --use-checkpoint-args).
"""
from megatron_smp.post_training.dpo_training import train_dpo
from megatron_smp.training import main
from pretrain_gpt import model_provider

if __name__ == "__main__":
    main(lambda: train_dpo(model_provider,
                           args_defaults={"tokenizer_type": "HuggingFaceTokenizer"}))
