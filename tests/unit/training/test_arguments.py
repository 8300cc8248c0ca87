import math

import pytest

from megatron_smp.config import ConfigError, OptimizerConfig
from megatron_smp.training.arguments import parse_args
from megatron_smp.training.optimizer_param_scheduler import OptimizerParamScheduler

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--train-iters 10 --mock-data --micro-batch-size 2"
).split()


def test_flags_fill_the_configs():
    configs = parse_args(
        BASE + "--swiglu --group-query-attention --num-query-groups 2 --bf16 "
        "--position-embedding-type rope --use-flash-attn --transformer-impl local "
        "--tensor-model-parallel-size 1 --lr 3e-4 --lr-warmup-fraction 0.2".split()
    )
    model = configs.model
    assert model.gated_linear_unit and model.activation == "silu"
    assert model.ffn_hidden_size == 128  # Megatron's 2/3 * 4h rounded to 64
    assert model.num_query_groups == 2 and model.position_embedding_type == "rope"
    assert model.bf16 and configs.optimizer.bf16 and str(model.params_dtype) == "torch.bfloat16"
    assert configs.optimizer.lr == 3e-4 and configs.optimizer.lr_warmup_iters == 2
    assert configs.optimizer.lr_decay_iters == 10
    assert model.max_position_embeddings == 32


def test_openai_gelu_selects_gpt2_activation():
    assert parse_args(BASE + ["--openai-gelu"]).model.activation == "gelu_tanh"
    with pytest.raises(ConfigError, match="--openai-gelu"):
        parse_args(BASE + ["--openai-gelu", "--swiglu"])


def test_args_defaults_from_entry_script():
    configs = parse_args(BASE, args_defaults={"normalization": "RMSNorm", "swiglu": True})
    assert configs.model.normalization == "RMSNorm" and configs.model.gated_linear_unit


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--num-attention-heads 3 --hidden-size 66", "--tensor-model-parallel-size"),
        ("--max-position-embeddings 16", "--max-position-embeddings (16)"),
        ("--global-batch-size 3", "--global-batch-size (3)"),
        ("--fp16 --bf16", "mutually exclusive"),
        ("--num-query-groups 2", "--group-query-attention"),
        ("--save-interval 5", "--save DIR"),
    ],
)
def test_bad_configurations_name_the_flag(extra, message, monkeypatch):
    argv = BASE + extra.split()
    if "3 --hidden-size" in extra:
        argv += ["--tensor-model-parallel-size", "2"]
        monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv)


def test_unknown_flag_value_exits(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(BASE + ["--lr-decay-style", "exponential"])
    assert info.value.code != 0
    assert "--lr-decay-style" in capsys.readouterr().err


def test_world_size_must_be_product_of_degrees(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="world size 3"):
        parse_args(BASE + ["--tensor-model-parallel-size", "2"])


class _FakeOptimizer:
    def __init__(self):
        self.param_groups = [{"lr": 0.0}, {"lr": 0.0, "wd_mult": 0.0}]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_schedule(style):
    config = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=10,
                             lr_decay_style=style, weight_decay=0.5)
    opt = _FakeOptimizer()
    scheduler = OptimizerParamScheduler(opt, config, train_iters=10)
    lrs = []
    for _ in range(12):
        scheduler.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    if style == "constant":
        assert lrs[-1] == 1.0
    else:
        assert lrs[9] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1)
        mid = 0.1 + 0.9 * (0.5 if style == "linear" else 0.5 * (math.cos(math.pi / 2) + 1))
        assert lrs[5] == pytest.approx(mid)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[0]["weight_decay"] == 0.5


def test_smp_config_keys_override_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    path = tmp_path / "smp.json"
    path.write_text('{"tensor_parallel_degree": 2, "shard_optimizer_state": true, '
                    '"random_seed": 99}')
    configs = parse_args(BASE + ["--smp-config", str(path), "--global-batch-size", "4"])
    assert configs.parallel.tensor_model_parallel_size == 2
    assert configs.optimizer.use_distributed_optimizer and configs.training.seed == 99
    with pytest.raises(ConfigError, match="tensor_parallel_degree"):
        parse_args(BASE + ["--smp-config", '{"tensor_parallel_degree": "two"}'])
    with pytest.raises(ConfigError, match="unknown config key"):
        parse_args(BASE + ["--smp-config", '{"tensor_parallel": 2}'])
