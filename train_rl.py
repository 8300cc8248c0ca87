"""On-policy RL (GRPO, DAPO, Dr. GRPO, GSPO) with Megatron-LM's flags and rollouts from the
in-framework inference engine on the weights being trained.

    torchrun --nproc-per-node 2 train_rl.py --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model hf_dir --use-checkpoint-args --load sft_ckpt --finetune \
        --save rl_ckpt --save-interval 20 --seq-length 256 --micro-batch-size 8 \
        --train-iters 100 --lr 1e-5 \
        --langrl-env-config megatron_smp/post_training/envs/addition.yaml \
        --grpo-group-size 8 --grpo-prompts-per-step 16 --grpo-iterations 1 \
        --grpo-kl-beta 0.0 --grpo-clamp-eps-lower 0.2 --grpo-clamp-eps-upper 0.28 \
        --rl-default-temperature 1.0 --rl-max-completion-length 32

--global-batch-size is --grpo-group-size x --grpo-prompts-per-step (one rollout per
sequence). The model flags are pretrain_gpt.py's (give the Llama ones, or
--use-checkpoint-args). See megatron_smp/post_training/rl_training.py for the loop.
"""
from megatron_smp.post_training.rl_training import train_rl
from megatron_smp.training import main
from pretrain_gpt import model_provider

if __name__ == "__main__":
    main(lambda: train_rl(model_provider,
                          args_defaults={"tokenizer_type": "HuggingFaceTokenizer"}))
