"""Every flag of Megatron-LM main's parser is implemented, ignored (with its reason), or refused
with a ConfigError naming it (megatron_smp/training/arguments/megatron_lm.py), and what the
flags of megatron_lm.IMPLEMENTED and ALIASES do."""
import json
import os
import pathlib

import pytest

from megatron_smp.config import ConfigError
from megatron_smp.training.arguments import megatron_lm, parse_args

ROOT = pathlib.Path(__file__).resolve().parents[3]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "2", "--mock-data", "--vocab-size", "100"]


def test_audit_of_megatron_parsers_finds_no_missing_flag():
    """tests/fixtures/megatron_parser_flags.json: the flags the parsers of Megatron-LM main,
    megatron-core 0.19.2 and core_v0.16.1 declare (as tools/megatron_flag_audit.py --arguments
    reads them); each is accepted or a ConfigError naming it, none rejected by argparse."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from megatron_flag_audit import audit_parser

    with open(ROOT / "tests" / "fixtures" / "megatron_parser_flags.json") as handle:
        parsers = json.load(handle)["parsers"]
    declared = set()
    for name, rows in parsers.items():
        specs = [dict(zip(("flag", "nargs", "type", "choices"), row)) for row in rows]
        result = audit_parser(specs)
        assert result["missing"] == [], name
        for flag in megatron_lm.MEGATRON_ERRORS:
            assert flag in result["error"], (name, flag)
        declared |= {spec["flag"] for spec in specs}
    assert {name: len(rows) for name, rows in parsers.items()} == {
        "main d98e8a64dd": 876, "megatron-core 0.19.2": 845, "core_v0.16.1": 680}
    # The tables of megatron_lm.py name flags of those parsers only, each in one table.
    tables = [set(megatron_lm.ALIASES), set(megatron_lm.NEGATED_ALIASES),
              {flag for flag, *_ in megatron_lm.IMPLEMENTED}, set(megatron_lm.IGNORED),
              set(megatron_lm.MEGATRON_ERRORS), set(megatron_lm.NEEDS_NVIDIA),
              set(megatron_lm.NOT_BUILT)]
    assert sum(len(table) for table in tables) == len(set().union(*tables))
    assert set().union(*tables) <= declared


def _fields(configs):
    return {name: vars(getattr(configs, name)) for name in ("model", "training", "optimizer",
                                                            "data", "checkpoint", "parallel")}


@pytest.mark.parametrize("alias, extra", [
    ("--disable-log-loss-scale-to-tensorboard", []), ("--disable-manual-gc-eval", []),
    ("--override-opt-param-scheduler", []), ("--use-checkpoint-opt-param-scheduler", []),
    ("--torch-fsdp2-no-reshard-after-forward", ["--use-torch-fsdp2"]),
    ("--tokenizer-special-tokens", ["<a>", "<b>"]),
])
def test_aliases_set_what_the_flag_they_spell_sets(alias, extra):
    flag = megatron_lm.ALIASES[alias]
    default = _fields(parse_args(BASE + [e for e in extra if e.startswith("--")]))
    spelled = _fields(parse_args(BASE + [alias] + extra))
    assert spelled == _fields(parse_args(BASE + [flag] + extra))
    assert spelled != default


def test_negated_alias_clears_the_field():
    given = parse_args(BASE + ["--tokenizer-hf-include-special-tokens"]).data
    assert given.tokenizer_hf_include_special_tokens is True
    cleared = parse_args(BASE + ["--tokenizer-hf-include-special-tokens",
                                 "--tokenizer-hf-no-include-special-tokens"]).data
    assert cleared.tokenizer_hf_include_special_tokens is False


def test_megatron_errors_and_post_processed_flags():
    # Megatron-LM's own refusals, with its text.
    with pytest.raises(ConfigError, match="--batch-size argument is no longer valid, use "
                                          "--micro-batch-size instead"):
        parse_args(BASE + ["--batch-size", "4"])
    with pytest.raises(ConfigError, match="--checkpoint-activations is no longer valid"):
        parse_args(BASE + ["--checkpoint-activations"])
    # --no-weight-decay-cond-type: Megatron's deprecated spelling of --apply-wd-to-qk-layernorm.
    assert not parse_args(BASE + ["--qk-layernorm"]).optimizer.apply_wd_to_qk_layernorm
    assert parse_args(BASE + ["--qk-layernorm", "--no-weight-decay-cond-type",
                              "apply_wd_to_qk_layernorm"]).optimizer.apply_wd_to_qk_layernorm
    with pytest.raises(ConfigError, match="Invalid no_weight_decay_cond_type: other"):
        parse_args(BASE + ["--no-weight-decay-cond-type", "other"])
    # --dataloader-type single is the sampler here; the others are refused.
    assert _fields(parse_args(BASE + ["--dataloader-type", "single"])) == _fields(
        parse_args(BASE))
    with pytest.raises(ConfigError, match="--dataloader-type cyclic"):
        parse_args(BASE + ["--dataloader-type", "cyclic"])
    parse_args(BASE + ["--null-tokenizer-pad-id", "-1"])
    with pytest.raises(ConfigError, match="--null-tokenizer-pad-id 7"):
        parse_args(BASE + ["--null-tokenizer-pad-id", "7"])
    with pytest.raises(ConfigError, match="--no-initialization .*--load"):
        parse_args(BASE + ["--no-initialization"])
    parse_args(BASE + ["--no-initialization", "--load", "somewhere"])
    for flag in (["--ckpt-step", "3"], ["--exit-on-missing-checkpoint"]):
        with pytest.raises(ConfigError, match=f"{flag[0]} applies to the --load"):
            parse_args(BASE + flag)
    # --mtp-hybrid-override-pattern: Megatron's conversion into the unified pattern.
    hybrid = ["--hybrid-layer-pattern", "M*", "--mamba-num-heads", "4", "--mtp-num-layers", "2"]
    model = parse_args(BASE + hybrid + ["--mtp-hybrid-override-pattern", "*"]).model
    assert model.hybrid_layer_pattern == "M*/*/*" and model.num_layers == 2
    with pytest.raises(ConfigError, match="--mtp-hybrid-override-pattern .*--hybrid-layer"):
        parse_args(BASE + ["--mtp-hybrid-override-pattern", "*"])
    # Refusals name the flag and what it belongs to; ignored flags parse.
    with pytest.raises(ConfigError, match="--bert-load .*BERT or T5"):
        parse_args(BASE + ["--bert-load", "x"])
    with pytest.raises(ConfigError, match="--enable-cuda-graph needs CUDA graphs"):
        parse_args(BASE + ["--enable-cuda-graph"])
    assert _fields(parse_args(BASE + ["--high-priority-stream-groups", "dp", "tp",
                                      "--ddp-num-buckets", "4", "--nvtx-ranges"])) == _fields(
        parse_args(BASE))


def _ckpt_runs(rank, world_size, runs):
    """pretrain_gpt runs: each run's lm losses by iteration and where it resumed, or the
    error it raised."""
    from megatron_smp.config import ConfigError
    from megatron_smp.training import pretrain
    from pretrain_gpt import forward_step, model_provider, train_valid_test_datasets_provider

    import torch

    from megatron_smp.models import GPTModel
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.training.arguments import parse_args

    # --embedding-init-method-std: the same draws scaled, every other weight unchanged.
    from megatron_smp.tensor_parallel.random import model_parallel_seed

    state = build_parallel_state()
    weights = []
    for extra in ([], ["--embedding-init-method-std", "0.5"]):
        model_parallel_seed(1234, state)
        model = GPTModel(parse_args(BASE + ["--untie-embeddings-and-output-weights"] + extra)
                         .model.replace(vocab_size=100), state)
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()
                        if torch.is_tensor(v)})
    out = [{name: (weights[1][name][:10] / weights[0][name][:10]).mean().item()
            if "embedding" in name else bool(torch.equal(weights[0][name], weights[1][name]))
            for name in weights[0]}]
    # --init-method-xavier-uniform: each matrix uniform within sqrt(6 / (fan in + fan out)).
    model_parallel_seed(1234, state)
    model = GPTModel(parse_args(BASE + ["--untie-embeddings-and-output-weights",
                                       "--init-method-xavier-uniform"])
                     .model.replace(vocab_size=100), state)
    xavier = {}
    for name, param in model.named_parameters():
        if param.dim() == 2:
            # The vocabulary's tables are drawn over its 100 rows (the padding stays zero).
            vocabulary = "word_embeddings" in name or "output_layer" in name
            weight = param.detach()[:100] if vocabulary else param.detach()
            bound = (6 / (weight.shape[0] + weight.shape[1])) ** 0.5
            xavier[name] = (weight.abs().max().item() / bound,
                            weight.std().item() / (bound / 3 ** 0.5))
    out.append(xavier)
    for argv in runs:
        try:
            result = pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                              argv=argv)
        except ConfigError as error:
            out.append(str(error))
            continue
        out.append({i: v["lm loss"] for i, v in result.train_losses.items()})
    return out


def test_ckpt_step_and_exit_on_missing_checkpoint(tmp_path):
    """--embedding-init-method-std scales the embeddings' draws, nothing else;
    --init-method-xavier-uniform draws every matrix (embeddings included) Xavier-uniform. Saves at 2 and 4 of a 4-iteration run; --ckpt-step 2 resumes from iteration 2 (not the
    tracker's 4): iterations 3 and 4 again, with the first run's losses. An empty --load with
    --exit-on-missing-checkpoint is an error, not a run from scratch."""
    from megatron_smp.testing import run_distributed
    from tests.functional.test_training_parity import COMMON

    save = str(tmp_path / "ckpt")
    argv = [a if a != "10" else "4" for a in COMMON]  # --train-iters 4
    first = argv + ["--save", save, "--save-interval", "2"]
    again = argv + ["--load", save, "--ckpt-step", "2"]
    missing = argv + ["--load", str(tmp_path / "empty"), "--exit-on-missing-checkpoint"]
    (scaled, xavier, whole, resumed, error), = run_distributed(_ckpt_runs, 1,
                                                               args=([first, again, missing],))
    assert len(xavier) == 11  # word and position tables, 2 x (qkv, proj, fc1, fc2), output
    for name, (largest, std) in xavier.items():
        assert 0.9 < largest <= 1.0 and std == pytest.approx(1.0, abs=0.15), name
    embeddings = {name: ratio for name, ratio in scaled.items() if "embedding" in name}
    assert len(embeddings) == 2  # word and position tables: 0.5 / 0.02 = 25 x the draws
    assert all(ratio == pytest.approx(25.0, rel=1e-5) for ratio in embeddings.values()), scaled
    assert all(same for name, same in scaled.items() if name not in embeddings), scaled
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]
    assert sorted(resumed) == [3, 4]
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(whole[iteration], rel=1e-6)
    assert "--exit-on-missing-checkpoint is set but no checkpoint was found" in error


def test_spiky_loss_and_large_grads_checks():
    """Megatron's is_unexpectedly_large (threshold 10 over the largest of the first 100
    finite values, per context), non-fatal: validate_results reruns the iteration in place
    and goes on; disabled logs and goes on. The first iteration of validate_results is not
    checked (nor counted)."""
    import types

    import torch

    from megatron_smp.training.result_validation import MESSAGES, ResultValidator
    from megatron_smp.training.trainer import _build_validator

    state = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    logs = []
    validator = ResultValidator("validate_results", state, lambda m, every_rank=False:
                                logs.append(m), nan=False, spiky_loss=True, large_grads=True)
    reruns = []

    def step(iteration, losses, grad_norm=None, rerun_losses=None):
        validator.start_iteration(iteration, None)
        for loss in losses:
            validator.check_loss(torch.tensor(loss))
        if grad_norm is not None:
            validator.check_grads(torch.tensor([grad_norm]))
        counts = validator.local_counts()

        def rerun():
            reruns.append(iteration)
            for loss in rerun_losses or losses:
                validator.check_loss(torch.tensor(loss))
        validator.finish_step(None, None, rerun, None if counts is None else counts.tolist())
        return None if counts is None else counts.tolist()

    assert step(1, [1000.0]) is None  # the first iteration: not checked, not counted
    for i in range(50):  # 100 loss samples (largest 2.0), NaN not counted; 50 grad norms
        assert step(2 + i, [1.0, 2.0 if i == 7 else 1.5, float("nan")], grad_norm=3.0) == \
            [0.0] * len(MESSAGES)
    assert step(52, [19.9], grad_norm=3.0) == [0.0] * len(MESSAGES)  # < 10 x 2.0
    assert reruns == []
    assert step(53, [20.0])[4] == 1.0  # >= 10 x 2.0: rerun in place, reproduced, go on
    assert reruns == [53] and "reproducible within the tolerance. Training goes on" in logs[-1]
    assert step(54, [25.0], rerun_losses=[1.0])[4] == 1.0
    assert reruns == [53, 54] and "not reproducible" in logs[-1]
    # The grad norms: still sampling (50 + 1 of 100), so a large one is counted, not rejected.
    assert step(55, [1.0], grad_norm=1e6)[5] == 0.0
    for i in range(48):
        step(56 + i, [1.0], grad_norm=3.0)
    assert step(104, [1.0], grad_norm=1e6)[5] == 0.0  # the largest is now 1e6
    assert step(105, [1.0], grad_norm=1e7)[5] == 1.0
    assert MESSAGES[5] in logs[-3]

    disabled = ResultValidator("disabled", state, lambda m, every_rank=False: logs.append(m),
                               nan=True, spiky_loss=True)
    for iteration in range(1, 102):
        disabled.start_iteration(iteration, None)
        disabled.check_loss(torch.tensor(30.0 if iteration == 101 else 1.0))
        counts = disabled.local_counts().tolist()
        disabled.finish_step(None, None, lambda: reruns.append("disabled"), counts)
    assert counts[4] == 1.0 and "training goes on" in logs[-1] and "disabled" not in reruns

    # The flags reach the trainer's validator, without the NaN checks when those are off.
    configs = parse_args(BASE + ["--check-for-spiky-loss", "--check-for-large-grads",
                                 "--no-check-for-nan-in-loss-and-grad"])
    built = _build_validator(configs, state, [])
    assert (built.nan, built.spiky_loss, built.large_grads) == (False, True, True)
    assert _build_validator(parse_args(BASE + ["--no-check-for-nan-in-loss-and-grad"]), state,
                            []) is None


def test_weight_decay_schedule():
    """--weight-decay-incr-style linear / cosine: Megatron's get_wd from --start-weight-decay
    to --end-weight-decay over train_iters x global batch samples, on every decayed group
    (no-decay groups stay at 0); checked against a checkpoint's schedule on resume."""
    import math

    import torch

    from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler

    flags = ["--global-batch-size", "4", "--train-iters", "10", "--lr", "1e-3"]
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    for style, coeff in (("linear", lambda r: r),
                         ("cosine", lambda r: 0.5 * (math.cos(math.pi * (1 - r)) + 1))):
        config = parse_args(BASE + flags + ["--weight-decay-incr-style", style,
                                            "--start-weight-decay", "0.02",
                                            "--end-weight-decay", "0.1"]).optimizer
        config.validate()
        optimizer = torch.optim.AdamW([{"params": params[:1]},
                                       {"params": params[1:], "wd_mult": 0.0}])
        scheduler = OptimizerParamScheduler(optimizer, config, 10, global_batch_size=4)
        done = 0
        for samples in (0, 4, 20, 36, 40, 44):
            scheduler.step(samples - done)
            done = samples
            expected = 0.02 + coeff(min(samples, 40) / 40) * 0.08
            assert scheduler.get_wd() == pytest.approx(expected, rel=1e-12)
            assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(expected)
            assert optimizer.param_groups[1]["weight_decay"] == 0.0
        saved = scheduler.state_dict()
        assert (saved["start_wd"], saved["end_wd"], saved["wd_incr_steps"],
                saved["wd_incr_style"]) == (0.02, 0.1, 40, style)
    constant = OptimizerParamScheduler(torch.optim.AdamW(params), parse_args(
        BASE + flags + ["--weight-decay", "0.05"]).optimizer, 10, global_batch_size=4)
    assert constant.get_wd() == 0.05
    with pytest.raises(ConfigError, match="--weight-decay-incr-style: checkpoint 'cosine', "
                                          "command line 'constant'"):
        constant.load_state_dict(dict(saved, max_lr=1e-3, start_wd=0.05, end_wd=0.05))
    for extra, match in ((["--weight-decay-incr-style", "linear"], "needs --start-weight-decay"),
                         (["--start-weight-decay", "0.1"], "need --weight-decay-incr-style"),
                         (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.2",
                           "--end-weight-decay", "0.1"], "at most --end-weight-decay")):
        with pytest.raises(ConfigError, match=match):
            parse_args(BASE + extra).optimizer.validate()
