"""The example launch scripts (scripts/pretrain_*.sh and the CPU-sized scripts/small/) pass
flags that parse and validate at their world size and build the model they say (checked
without a launch: a stub interpreter, PYTHON for scripts/launch_env.sh, records the
launcher's command line)."""
import os
import stat
import subprocess

import pytest

from megatron_smp.training.arguments import parse_args, validate_configs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
SCRIPTS = {
    "pretrain_gpt_125m.sh": dict(num_layers=12, hidden_size=768),
    "pretrain_llama2_7b.sh": dict(num_layers=32, ffn_hidden_size=11008),
    "pretrain_mixtral_8x7b.sh": dict(num_moe_experts=8, moe_router_topk=2, num_query_groups=8),
    "pretrain_llama31_8b.sh": dict(use_rope_scaling=True, rope_scaling_factor=8.0,
                                   rotary_base=500000.0, num_query_groups=8),
    "pretrain_qwen25_7b.sh": dict(add_qkv_bias=True, add_bias_linear=False,
                                  position_embedding_type="rope", num_query_groups=4),
    "pretrain_qwen3_moe_30b_a3b.sh": dict(qk_layernorm=True, kv_channels=128,
                                          num_moe_experts=128, moe_router_topk=8,
                                          moe_router_pre_softmax=False),
    "small/pretrain_llama31_small.sh": dict(use_rope_scaling=True,
                                            rope_scaling_original_max_position_embeddings=64),
    "small/pretrain_qwen25_small.sh": dict(
        add_qkv_bias=True, position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
        untie_embeddings_and_output_weights=False),
    "small/pretrain_qwen3_moe_small.sh": dict(qk_layernorm=True, kv_channels=48,
                                              num_moe_experts=8),
    "pretrain_gpt_oss_20b.sh": dict(softmax_type="learnable", window_attn_skip_freq=2,
                                    activation="quick_gelu", glu_linear_offset=1.0,
                                    activation_func_clamp_value=7.0, num_moe_experts=32,
                                    position_embedding_type="yarn"),
    "small/pretrain_gpt_oss_small.sh": dict(softmax_type="learnable", window_size=(15, 0),
                                            activation="quick_gelu", num_moe_experts=4),
    "pretrain_gemma3_1b.sh": dict(sandwich_norm=True, apply_embedding_scaling=True,
                                  local_rotary_base=10000.0, window_attn_skip_freq=6,
                                  softmax_scale=0.0625, activation="gelu_tanh"),
    "small/pretrain_gemma3_small.sh": dict(sandwich_norm=True, kv_channels=48,
                                           rotary_seq_len_interpolation_factor=8.0),
    "pretrain_deepseek_v3_671b.sh": dict(
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=1536, kv_lora_rank=512,
        position_embedding_type="yarn", yarn_rotary_scaling_factor=40.0, yarn_mscale_all_dim=1.0,
        num_moe_experts=256, moe_router_num_groups=8, moe_router_group_topk=4,
        moe_router_enable_expert_bias=True, mtp_num_layers=1),
    "pretrain_nemotron_h_8b.sh": dict(num_layers=52, mamba_num_heads=128, mamba_num_groups=8,
                                      activation="squared_relu", position_embedding_type="none"),
    "small/pretrain_nemotron_h_small.sh": dict(hybrid_layer_pattern="M-E|M*-", num_layers=6,
                                               moe_router_score_function="sigmoid"),
    "pretrain_qwen3_next_80b_a3b.sh": dict(linear_attention_freq=4, attention_output_gate=True,
                                           rotary_percent=0.25, num_moe_experts=512,
                                           moe_shared_expert_gate=True),
    "small/pretrain_qwen3_next_small.sh": dict(linear_attention_freq=4, num_moe_experts=8,
                                               layernorm_zero_centered_gamma=True),
    "small/pretrain_deepseek_v3_small.sh": dict(
        multi_latent_attention=True, qk_layernorm=True, position_embedding_type="yarn",
        yarn_original_max_position_embeddings=128, num_moe_experts=8, mtp_num_layers=1,
        recompute_modules=["mla_up_proj"]),
}


def _command_line(script, tmp_path, env=()):
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$STUB_OUT"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "argv.txt"
    environment = dict(os.environ, PYTHON=str(stub), GPUS_PER_NODE="8", STUB_OUT=str(out),
                       DATA_PATH="data", VOCAB="vocab.json", MERGES="merges.txt",
                       TOKENIZER_MODEL="tokenizer", CHECKPOINT_PATH=str(tmp_path / "ckpt"),
                       OUT=str(tmp_path / "out"), **dict(env))
    subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], env=environment,
                   check=True, timeout=30)
    return out.read_text().splitlines()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_flags_validate(script, tmp_path):
    from pretrain_llama import LLAMA_DEFAULTS

    argv = _command_line(script, tmp_path)
    index = next(i for i, token in enumerate(argv) if token.endswith(".py"))
    launcher, entry, flags = argv[:index], argv[index], argv[index + 1:]
    world_size = int(launcher[launcher.index("--nproc-per-node") + 1])
    if "--nnodes" in launcher:
        world_size *= int(launcher[launcher.index("--nnodes") + 1])
    defaults = LLAMA_DEFAULTS if entry == "pretrain_llama.py" else None
    configs = parse_args(flags, args_defaults=defaults)
    configs.model.vocab_size = 151936  # the tokenizer's, in a run
    validate_configs(configs, world_size)
    for field, value in SCRIPTS[script].items():
        assert getattr(configs.model, field) == value, (script, field)


def test_qwen25_yarn_knob(tmp_path):
    flags = _command_line("pretrain_qwen25_7b.sh", tmp_path, {"YARN": "1"})
    configs = parse_args(flags[flags.index("pretrain_llama.py") + 1:])
    assert configs.model.position_embedding_type == "yarn"
    assert configs.model.yarn_original_max_position_embeddings == 32768


def _launch(env, tmp_path):
    """LAUNCH as scripts/launch_env.sh resolves it in `env` (no nvidia-smi on PATH)."""
    script = f'source "{ROOT}/scripts/launch_env.sh"; printf "%s\\n" "${{LAUNCH[@]}}"'
    environment = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}
    out = subprocess.run(["bash", "-c", script], env=environment, capture_output=True,
                         text=True, timeout=30, check=True)
    return out.stdout.splitlines()


def test_launch_environment_resolution(tmp_path):
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/bin/sh\n")
    (venv / "python").chmod(0o755)
    # No GPU anywhere: the CPUs SLURM gave the task, gloo processes, the active environment.
    launch = _launch({"SLURM_CPUS_PER_TASK": "3", "VIRTUAL_ENV": str(venv.parent)}, tmp_path)
    assert launch[:3] == [str(venv / "python"), "-m", "torch.distributed.run"]
    assert launch[launch.index("--nproc-per-node") + 1] == "3" and "--standalone" in launch
    # SLURM's --gpus-per-node with a type, and the rendezvous through MASTER_ADDR.
    launch = _launch({"SLURM_GPUS_PER_NODE": "h100:4", "MASTER_ADDR": "node1",
                      "MASTER_PORT": "23456", "NNODES": "2", "PYTHON": "/x/python"}, tmp_path)
    assert launch[launch.index("--nproc-per-node") + 1] == "4"
    assert launch[launch.index("--nnodes") + 1] == "2"
    assert launch[launch.index("--rdzv-endpoint") + 1] == "node1:23456"
    # One SLURM task per rank: the interpreter alone.
    assert _launch({"LAUNCHER": "srun", "PYTHON": "/x/python"}, tmp_path) == ["/x/python"]
    with pytest.raises(subprocess.CalledProcessError):
        _launch({"LAUNCHER": "mpirun", "PYTHON": "/x/python"}, tmp_path)


def test_finetune_llama_lora_steps(tmp_path):
    """scripts/finetune_llama_lora.sh: preprocess the bundled chats with the model's tokenizer,
    convert the HF model once, LoRA --sft training over the base (--pretrained-checkpoint),
    resuming its own small checkpoints when there (--load), export PEFT + merged HF; the
    training flags parse and validate."""
    from pretrain_llama import LLAMA_DEFAULTS

    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" ---- >> "$STUB_OUT"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "argv.txt"

    def steps():
        out.write_text("")
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "finetune_llama_lora.sh"),
                        "--seed", "3"], check=True, timeout=30,
                       env=dict(os.environ, PYTHON=str(stub), GPUS_PER_NODE="0",
                                NPROC_PER_NODE="2", STUB_OUT=str(out), HF_MODEL="hf/llama",
                                OUT=str(tmp_path / "run")))
        return [step.strip("\n").splitlines() for step in out.read_text().split("----")[:-1]]

    preprocess, convert, train, export, *answer = steps()
    # Then the merged model, converted back, answers the data's first questions.
    back, _, generate, _ = answer
    assert back[back.index("--load-dir") + 1] == str(tmp_path / "run" / "hf_merged")
    assert generate[0] == "tools/generate.py"
    assert generate[generate.index("--load") + 1] == str(tmp_path / "run" / "merged")
    assert preprocess[0] == "tools/preprocess_sft_data.py"
    assert preprocess[preprocess.index("--input") + 1] == "data/chat/tiny_chat.jsonl"
    assert preprocess[preprocess.index("--tokenizer-model") + 1] == "hf/llama"
    assert convert[convert.index("--loader") + 1] == "hf"
    assert export[export.index("--loader") + 1] == "megatron_smp" and "--peft-dir" in export
    entry = train.index("pretrain_llama.py")
    assert train[train.index("--nproc-per-node") + 1] == "2"
    flags = train[entry + 1:]
    # The base named by --pretrained-checkpoint; --load of the run's own (small) checkpoints.
    assert flags[flags.index("--pretrained-checkpoint") + 1] == str(tmp_path / "run" / "base")
    assert flags[flags.index("--load") + 1] == str(tmp_path / "run" / "lora")
    assert "--finetune" not in flags and flags[-2:] == ["--seed", "3"]
    # The model's shape comes from the converted checkpoint (--use-checkpoint-args); here
    # stand-in shape flags let the rest parse and validate at the script's world size.
    flags.remove("--use-checkpoint-args")
    configs = parse_args(flags + ["--num-layers", "2", "--hidden-size", "64",
                                  "--num-attention-heads", "4"], args_defaults=LLAMA_DEFAULTS)
    configs.model.vocab_size = 32000
    validate_configs(configs, 2)
    assert configs.data.sft and configs.training.lora_rank == 16
    # The base converted: no second conversion, the same training flags (resume or start).
    (tmp_path / "run" / "base").mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "base" / "latest_checkpointed_iteration.txt").write_text("0")
    preprocess, again, export, *answer = steps()
    assert again == train and len(answer) == 4


def test_deepseek_v3_671b_script_is_the_published_shape(tmp_path):
    """scripts/pretrain_deepseek_v3_671b.sh: 671.0B parameters in the main model (DeepSeek's
    671B) plus 11.6B in its MTP layer (its norms, eh_proj and MoE layer; the embedding and
    head are shared), validated at its default layout (PP=16 as 3 + 14 x 4 + 2 layers, EP=64,
    1024 ranks); --log-throughput's FLOPs per token at seq 4096: 260.0 G, 249.8 G without the
    MTP layer (DeepSeek publishes 250 G)."""
    from megatron_smp.training.logging import flops_per_iteration

    argv = _command_line("pretrain_deepseek_v3_671b.sh", tmp_path)
    configs = parse_args(argv[argv.index("pretrain_gpt.py") + 1:])
    configs.model.vocab_size = 129280
    validate_configs(configs, 1024)
    model, parallel = configs.model, configs.parallel
    assert (parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size,
            parallel.decoder_first_pipeline_num_layers) == (16, 64, 3)
    h, n, vocab = model.hidden_size, model.num_attention_heads, model.padded_vocab_size(1)
    assert vocab == 129280
    attention = (h * model.q_lora_rank + model.q_lora_rank  # q down-projection, norm
                 + model.q_lora_rank * n * (model.qk_head_dim + model.qk_pos_emb_head_dim)
                 + h * (model.kv_lora_rank + model.qk_pos_emb_head_dim) + model.kv_lora_rank
                 + model.kv_lora_rank * n * (model.qk_head_dim + model.v_head_dim)
                 + n * model.v_head_dim * h + 2 * h)  # o_proj, the layer's two norms
    dense = 3 * h * model.ffn_hidden_size
    moe = (model.num_moe_experts * h  # router
           + (model.num_moe_experts * 3 + 3) * h * model.moe_ffn_hidden_size)  # + shared
    pattern = model.moe_layer_pattern()
    main = (model.num_layers * attention + pattern.count(0) * dense + pattern.count(1) * moe
            + 2 * vocab * h + h)
    mtp = 3 * h + 2 * h * h + attention + moe
    assert (round(main / 1e9, 1), round(mtp / 1e9, 1)) == (671.0, 11.6)
    seq = configs.training.seq_length
    per_token = flops_per_iteration(model, seq, 1, vocab) / seq / 1e9
    without_mtp = flops_per_iteration(model.replace(mtp_num_layers=None), seq, 1, vocab)
    assert (round(per_token, 1), round(without_mtp / seq / 1e9, 1)) == (260.0, 249.8)



@pytest.mark.parametrize("script, vocab", [("pretrain_deepseek_v3_671b.sh", 129279),
                                           ("pretrain_mixtral_8x7b.sh", 32000)])
def test_large_scripts_default_layouts_fit_80gb_per_the_planner(tmp_path, script, vocab):
    """The memory planner (the model built on meta at the script's own layout: 1024 ranks for
    DeepSeek-V3, 4 nodes for Mixtral) puts every rank of the script's defaults under 80 GB.
    Before: DeepSeek-V3 with selective recompute needed 164 GB on its second pipeline stage
    (15 micro-batches in flight under 1F1B), Mixtral on one node 117 GB per GPU."""
    from megatron_smp.training.memory_planner import GIB, report_from_argv
    from tools.estimate_memory import entry_script

    argv = _command_line(script, tmp_path)
    world = int(argv[argv.index("--nnodes") + 1]) * int(argv[argv.index("--nproc-per-node") + 1])
    entry = "llama" if "pretrain_llama.py" in argv else "gpt"
    argv = argv[argv.index(f"pretrain_{entry}.py") + 1:]
    for flag in ("--data-path", "--tokenizer-type", "--tokenizer-model"):
        at = argv.index(flag)
        del argv[at:at + 2]
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]
    provider, defaults = entry_script(entry)
    report = report_from_argv(argv, world, provider, defaults, "cuda")
    assert len(report.ranks) == (16 if "deepseek" in script else 4)
    assert report.largest.total < 80e9, report.table()
    assert report.largest.total > 20 * GIB  # the experts' and the optimizer's shares are there
