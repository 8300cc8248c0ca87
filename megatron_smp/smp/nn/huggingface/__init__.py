"""torch.sagemaker.nn.huggingface (and SMP v1's smdistributed.modelparallel.torch.nn.huggingface):
one module per Hugging Face family."""
# v1 scripts also reach the translators as attributes: smp.nn.huggingface.gpt2.translate_...
from megatron_smp.smp.nn.huggingface import gpt2, gptj, gptneox  # noqa: E402,F401
