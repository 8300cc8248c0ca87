"""pretrain with --use-torch-fsdp2: the single-process trajectory, checkpoints that resume under
DDP + the distributed optimizer at TP=2 (and the reverse), and the HF export of an FSDP2
checkpoint."""
import contextlib
import io
import warnings

import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.functional.test_checkpoint_resume import PROBE_SEED, _probe, _train
from tests.functional.test_training_parity import COMMON, LLAMA, baseline

warnings.filterwarnings("ignore", message=".*")
FSDP2 = ["--use-torch-fsdp2"]
TP2_DISTOPT = "--tensor-model-parallel-size 2 --use-distributed-optimizer".split()


def _losses(result, iterations):
    return [result["losses"][i] for i in iterations]


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_pretrain_fsdp2_matches_single_process(model):
    reference = baseline(model)
    argv = COMMON + (LLAMA if model == "llama" else []) + FSDP2
    results = run_distributed(_train, 2, args=(argv,), timeout=300)
    for result in results:
        assert _losses(result, range(1, 11)) == pytest.approx(reference, rel=1e-4)


def test_fsdp2_checkpoint_resumes_under_ddp_tp2_and_back_and_converts(tmp_path):
    import transformers

    from tests.unit.tools.test_convert import _convert_ok

    reference = baseline("llama")
    argv = COMMON + LLAMA
    first_half = ["--save-interval", "5", "--exit-interval", "5"]
    fsdp_dir, ddp_dir = str(tmp_path / "fsdp"), str(tmp_path / "ddp")

    saved = run_distributed(_train, 2, args=(argv + FSDP2 + first_half + ["--save", fsdp_dir],),
                            kwargs={"probe": True}, timeout=300)
    assert _losses(saved[0], range(1, 6)) == pytest.approx(reference[:5], rel=1e-4)
    resumed = run_distributed(_train, 2, args=(argv + TP2_DISTOPT + ["--load", fsdp_dir],),
                              timeout=300)
    assert _losses(resumed[0], range(6, 11)) == pytest.approx(reference[5:], rel=1e-4)

    run_distributed(_train, 2, args=(argv + TP2_DISTOPT + first_half + ["--save", ddp_dir],),
                    timeout=300)
    back = run_distributed(_train, 2, args=(argv + FSDP2 + ["--load", ddp_dir],), timeout=300)
    for result in back:
        assert _losses(result, range(6, 11)) == pytest.approx(reference[5:], rel=1e-4)

    # The FSDP2 checkpoint as a Hugging Face directory gives the logits the run had.
    _convert_ok("llama", "megatron_smp", "hf", fsdp_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    expected = _probe(saved, ("save", 5))
    tokens = torch.randint(0, expected.shape[-1], tuple(expected.shape[:2]),
                           generator=torch.Generator().manual_seed(PROBE_SEED))
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        logits = hf_model(tokens).logits
    assert (logits - expected).abs().max().item() < 1e-4
