"""Post-training on top of `training` and `inference`: DPO (losses with TRL's names,
preference data, the reference model), GRPO and its variants (rollouts, group advantages,
losses), and the backend API that post-training frameworks drive (`engine`: per-token
log-probs, the Hugging Face weight stream, offload / onload).

Imports point down: nothing in the library imports this package (entry scripts such as
`train_dpo.py` do).
"""
