"""train_dpo.py: DPO on the bundled preference pairs trains the same 10 iterations (1e-4) at
TP=2+SP, PP=2, CP=2, DP=2 with the distributed optimizer, FSDP2 and (MoE) EP=2 as in one
process (MoE at EP=2 also under FSDP2); the three reference modes agree (LoRA with adapters
off = a frozen copy; a precomputed pass = live); a run resumes exactly; the log line and
TensorBoard carry TRL's metric names."""
import json
import os

import pytest

from megatron_smp.testing import run_distributed
from tests.unit.data.sft_common import ROOT, make_chat_tokenizer, preprocess_sft_data

ITERS = 10
PREFERENCE = os.path.join(ROOT, "data", "chat", "tiny_preference.jsonl")
LLAMA = ("--normalization RMSNorm --swiglu --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear "
         "--group-query-attention --num-query-groups 2").split()
MOE = "--num-experts 4 --moe-router-topk 2".split()
LORA = "--lora-rank 4 --lora-alpha 8".split()
KEYS = ("dpo loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
        "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def dpo_argv(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dpo"))
    with open(PREFERENCE) as handle:
        records = [json.loads(line) for line in handle]
    tokenizer = make_chat_tokenizer(directory, records)
    prefix = os.path.join(directory, "pairs")
    preprocess_sft_data.preprocess(preprocess_sft_data.get_args(
        ["--input", PREFERENCE, "--output-prefix", prefix, "--tokenizer-model", tokenizer,
         "--preference", "--seq-length", "96"]))
    return (f"--data-path {prefix}_text_document --split 90,10,0 --tokenizer-type "
            f"HuggingFaceTokenizer --tokenizer-model {tokenizer} --seq-length 96 "
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
            "--max-position-embeddings 96 --micro-batch-size 2 --global-batch-size 4 "
            f"--train-iters {ITERS} --hidden-dropout 0 --attention-dropout 0 --lr 1e-3 "
            "--log-interval 1 --eval-interval 100 --eval-iters 1 --seed 7 "
            "--dpo-beta 0.5").split() + LLAMA


def _train(rank, world_size, argv, pad_like_context_parallel=None):
    """{key: [value per iteration]} and the last log line (then the validation lines);
    `pad_like_context_parallel`: pad
    the sequences as a run at that --context-parallel-size does (the reference of a CP run
    packs the same way)."""
    import contextlib
    import io

    import megatron_smp.data as data
    from megatron_smp.post_training.dpo_training import train_dpo
    from pretrain_gpt import model_provider

    if pad_like_context_parallel:
        build = data.build_train_valid_test_datasets

        def padded(*args, **kwargs):
            kwargs["context_parallel_size"] = pad_like_context_parallel
            return build(*args, **kwargs)

        data.build_train_valid_test_datasets = padded

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train_dpo(model_provider, argv=argv)
    losses = {key: [result.train_losses[i][key] for i in sorted(result.train_losses)]
              for key in KEYS}
    printed = out.getvalue().splitlines()
    lines = [line for line in printed if "consumed samples" in line]
    validation = [line for line in printed if "validation loss at iteration" in line]
    return losses, "\n".join(lines[-1:] + validation)


def _train_runs(rank, world_size, runs):
    """`_train` for each argv of `runs`, in turn in these processes."""
    return [_train(rank, world_size, argv) for argv in runs]


def _same(losses, expected, what):
    """Every key within 1e-4; rewards/accuracies from iteration 2 on: at iteration 1 the
    policy is the reference, every reward is 0 up to rounding, and which side of the tie a
    pair falls on depends on the order of the sums."""
    for key in KEYS:
        a, b = losses[key], expected[key]
        if key == "rewards/accuracies":
            a, b = a[1:], b[1:]
        assert len(a) == len(b) and all(abs(x - y) <= 1e-4 * max(1.0, abs(y))
                                        for x, y in zip(a, b)), (what, key, a, b)


@pytest.fixture(scope="module")
def single_process(dpo_argv, tmp_path_factory):
    """The one-process run (frozen-copy reference, from the initialisation), its last log
    line, TensorBoard dir and checkpoints (iterations 5 and 10)."""
    board = str(tmp_path_factory.mktemp("tb"))
    save = str(tmp_path_factory.mktemp("frozen"))
    (losses, line), = run_distributed(
        _train, 1, args=(dpo_argv + ["--tensorboard-dir", board, "--save", save,
                                     "--save-interval", "5",
                                     "--log-validation-ppl-to-tensorboard"],), timeout=300)
    return losses, line, board, save


def test_dpo_layouts_match_single_process(dpo_argv, single_process):
    """10 iterations of DPO (frozen-copy reference) at TP=2+SP, PP=2, DP=2 with the
    distributed optimizer and FSDP2 equal the single process's losses and metrics (1e-4);
    the log line and TensorBoard carry TRL's names; the validation line gives each of them
    Megatron's way ("<key> value: X |") with no perplexity (not even with
    --log-validation-ppl-to-tensorboard)."""
    import re

    from tests.functional.test_logging_flags import _scalars

    reference, line, board, _ = single_process
    assert reference["dpo loss"][-1] < reference["dpo loss"][0]
    scalars = _scalars(board)
    train_line, validation = line.split("\n")
    for key in KEYS:
        assert f" {key}: " in train_line
        assert [value for _, value in scalars[key]] == pytest.approx(reference[key], rel=1e-6)
        assert [step for step, _ in scalars[f"{key} validation"]] == [10]
    assert not any(tag.endswith("ppl") for tag in scalars)
    number = r"-?\d\.\d{6}E[-+]\d\d"
    assert re.fullmatch(r" validation loss at iteration 10 on validation set \|" + "".join(
        rf" {re.escape(key)} value: {number} \|" for key in sorted(KEYS)), validation), validation
    for flags in ("--tensor-model-parallel-size 2 --sequence-parallel",
                  "--pipeline-model-parallel-size 2",
                  "--use-distributed-optimizer",
                  "--use-torch-fsdp2"):
        for losses, _ in run_distributed(_train, 2, args=(dpo_argv + flags.split(),),
                                         timeout=300):
            _same(losses, reference, flags)


def test_dpo_context_and_expert_parallel_match_single_process(dpo_argv):
    """CP=2 (all_gather; each sequence split the load-balanced way) equals one process that
    packs alike; a Mixtral-style MoE at EP=2, with and without FSDP2, equals its one-process
    run (1e-4)."""
    cp = "--context-parallel-size 2 --cp-comm-type all_gather".split()
    (padded, _), = run_distributed(_train, 1, args=(dpo_argv, 2), timeout=300)
    assert len(padded["dpo loss"]) > 1
    for losses, _ in run_distributed(_train, 2, args=(dpo_argv + cp,), timeout=300):
        assert len(losses["dpo loss"]) == len(padded["dpo loss"])
        _same(losses, padded, "cp")
    (moe, _), = run_distributed(_train, 1, args=(dpo_argv + MOE,), timeout=300)
    assert len(moe["dpo loss"]) > 1
    ep2 = dpo_argv + MOE + ["--expert-model-parallel-size", "2"]
    # The second: experts an FSDP2 unit of their own (one rank each here).
    for per_rank in run_distributed(_train_runs, 2, args=([ep2, ep2 + ["--use-torch-fsdp2"]],),
                                    timeout=300):
        for (losses, _), what in zip(per_rank, ("ep2", "ep2 fsdp2")):
            assert len(losses["dpo loss"]) == len(moe["dpo loss"])
            _same(losses, moe, what)


def test_reference_modes_agree_and_resume_is_exact(dpo_argv, single_process, tmp_path):
    """LoRA with its adapters off as the reference equals a frozen copy of the base (also at
    TP=2+SP); a precomputed reference pass equals the live frozen copy (also computed over
    DP=2); a precomputed run resumed at
    iteration 5 (its reference log-probs read back from the checkpoint directory) repeats
    iterations 6-10 exactly, and so does a LoRA run (adapters-off) at DP=2."""
    lora = dpo_argv + LORA + ["--lr", "1e-2"]
    (frozen, _), = run_distributed(_train, 1, args=(lora + ["--dpo-reference", "frozen"],),
                                   timeout=300)
    (adapters_off, _), = run_distributed(_train, 1, args=(lora,), timeout=300)
    _same(adapters_off, frozen, "adapters-off vs frozen")
    for losses, _ in run_distributed(_train, 2, args=(
            lora + "--tensor-model-parallel-size 2 --sequence-parallel".split(),), timeout=300):
        _same(losses, frozen, "lora adapters-off tp=2")
    # The pairs differ from batch to batch, and so do the losses (0.47 to 0.70 here): that
    # the adapters learn shows in the mean of the last five iterations, not in the last alone.
    assert sum(frozen["dpo loss"][5:]) / 5 < frozen["dpo loss"][0] - 0.02, frozen["dpo loss"]

    save = str(tmp_path / "precomputed")
    full_frozen = single_process[0]
    saving = dpo_argv + ["--dpo-reference", "precomputed", "--save", save,
                         "--save-interval", "5"]
    (precomputed, _), = run_distributed(_train, 1, args=(saving,), timeout=300)
    _same(precomputed, full_frozen, "precomputed vs frozen")
    # At DP=2 the packs of the precomputing pass are shared out and the halves added up.
    for losses, _ in run_distributed(_train, 2, args=(
            dpo_argv + ["--dpo-reference", "precomputed"],), timeout=300):
        _same(losses, full_frozen, "precomputed dp=2")
    assert os.path.isfile(os.path.join(save, "dpo_reference_logps.npy"))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("5")
    (resumed, _), = run_distributed(_train, 1, args=(saving + ["--load", save],), timeout=300)
    assert all(resumed[key] == precomputed[key][5:] for key in KEYS), (resumed, precomputed)
    # A precomputed run's checkpoints record no starting weights to rebuild a frozen copy of.
    error, = run_distributed(_train, 1, args=(dpo_argv + ["--load", save],), timeout=300,
                             allow_errors=True)
    assert ("--dpo-reference frozen: resuming at iteration 10, but --load has no "
            "dpo_reference_source.json") in error

    save = str(tmp_path / "lora")
    saving = lora + ["--use-distributed-optimizer", "--save", save, "--save-interval", "5"]
    first = run_distributed(_train, 2, args=(saving,), timeout=300)
    _same(first[0][0], frozen, "lora dp=2")
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("5")
    for (resumed, _), (whole, _) in zip(run_distributed(_train, 2, args=(
            saving + ["--load", save],), timeout=300), first):
        assert all(resumed[key] == whole[key][5:] for key in KEYS), (resumed, whole)


def _set_latest(directory, iteration):
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(iteration))


def test_full_fine_tuning_frozen_reference_resumes_exactly(dpo_argv, single_process, tmp_path):
    """Full fine-tuning with a frozen copy resumes exactly: its reference is rebuilt from
    the recorded starting point -- the initialisation under --seed (one process), or the
    checkpoint the run started from with --finetune (TP=2+SP) -- and iterations 6-10 repeat
    the uninterrupted run's loss and six metrics; a clear error when that checkpoint is
    gone."""
    import shutil

    whole, _, _, start = single_process
    with open(os.path.join(start, "dpo_reference_source.json")) as handle:
        assert json.load(handle) == {"seed": 7}
    _set_latest(start, 5)
    (resumed, _), = run_distributed(_train, 1, args=(dpo_argv + [
        "--load", start, "--save", str(tmp_path / "resumed")],), timeout=300)
    assert all(resumed[key] == whole[key][5:] for key in KEYS), (resumed, whole)
    # The resumed run's own checkpoints record the same starting point.
    with open(tmp_path / "resumed" / "dpo_reference_source.json") as handle:
        assert json.load(handle) == {"seed": 7}

    # DPO from the iteration-5 checkpoint, at TP=2+SP, saving at 5 and 10, then resumed at 5.
    save = str(tmp_path / "from_checkpoint")
    argv = dpo_argv + ["--load", start, "--finetune", "--save", save, "--save-interval", "5",
                       "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    first = run_distributed(_train, 2, args=(argv,), timeout=300)
    with open(os.path.join(save, "dpo_reference_source.json")) as handle:
        assert json.load(handle) == {"load": os.path.abspath(start), "iteration": 5}
    # At iteration 1 the policy is its reference: every reward is 0.
    assert abs(first[0][0]["rewards/margins"][0]) < 1e-6, first[0][0]["rewards/margins"]
    _set_latest(save, 5)
    resume = [arg for arg in argv if arg != "--finetune"]
    resume[resume.index(start)] = save
    for (resumed, _), (uninterrupted, _) in zip(
            run_distributed(_train, 2, args=(resume,), timeout=300), first):
        assert all(resumed[key] == uninterrupted[key][5:] for key in KEYS), (
            resumed, uninterrupted)

    shutil.move(os.path.join(start, "iter_0000005"), str(tmp_path / "moved"))
    for error in run_distributed(_train, 2, args=(resume,), timeout=300, allow_errors=True):
        assert ("the reference is the checkpoint the run started from, "
                f"{os.path.join(os.path.abspath(start), 'iter_0000005')}, which is gone"
                ) in error, error
