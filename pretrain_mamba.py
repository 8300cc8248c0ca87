"""Megatron-LM's older name of pretrain_hybrid.py: the same hybrid stack and flags."""
from megatron_smp.training import main
from pretrain_hybrid import run

if __name__ == "__main__":
    main(run)
