"""Post-training on top of `training`: DPO (losses with TRL's names, preference data, the
reference model) and the backend API that post-training frameworks drive (`engine`:
per-token log-probs, the Hugging Face weight stream, offload / onload).

Imports point down: this package imports `training`, `models`, `data`; nothing in the
library imports it (the entry script `train_dpo.py` does).
"""
