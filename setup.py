from setuptools import find_packages, setup

setup(
    name="megatron_smp",
    version="0.1.0",
    description="Megatron-style training of GPT, Llama, Mistral, GPT-NeoX and Mixtral-style MoE "
    "models with tensor, sequence, context, expert, pipeline, data and FSDP2 sharded-data "
    "parallelism and a distributed optimizer, with the SageMaker model-parallel API.",
    packages=find_packages(include=["megatron_smp", "megatron_smp.*"]),
    # C sources compiled at first use (megatron_smp/native): index builders, CRC-32.
    package_data={"megatron_smp.data": ["helpers.c"], "megatron_smp.native": ["crc32.c"],
                  "megatron_smp.post_training.envs": ["*.yaml"]},
    python_requires=">=3.10",
    # torch is deliberately a range: scripts/setup_env.sh pins the CPU build before this
    # runs, and a GPU machine keeps whatever CUDA build it already has.
    install_requires=[
        "torch>=2.4",
        "numpy",
        "transformers>=4.45",
        "sentencepiece",
        "tensorboard",
        "safetensors",
        "tokenizers",
        # pyyaml: the RL environment configs (--langrl-env-config).
        "pyyaml",
    ],
    # pytest-xdist: scripts/run_tests.sh runs the suite on two worker processes.
    # tiktoken: only for --tokenizer-type TikTokenizer (imported when that is built).
    # peft: the tests load our exported LoRA adapters with it (the library never imports it).
    # trl: the tests train a transformed model with SFTTrainer(padding_free=True), and compare
    # our DPO losses with its DPOTrainer's (the library never imports it).
    # serve: the inference server (tools/run_text_generation_server.py; prometheus_client for
    # its /metrics); the tests drive it with the openai client and lm-evaluation-harness.
    extras_require={"test": ["pytest", "pytest-xdist", "tiktoken", "peft",
                             "trl",
                             "fastapi", "uvicorn", "prometheus_client", "openai", "requests",
                             "lm-eval[api]==0.4.13", "torchft==0.2.0"],
                    "tiktoken": ["tiktoken"],
                    "peft": ["peft"],
                    "serve": ["fastapi", "uvicorn", "prometheus_client"],
                    # --fault-tolerance: replica groups over torchft's lighthouse and manager.
                    "torchft": ["torchft==0.2.0"]},
)
