"""An OpenAI-compatible server (and Megatron's PUT /api) over a checkpoint, with Megatron's
flags for the model, checkpoint and layout. Rank 0 serves HTTP; every rank runs the model.

    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --load ckpt \
        --use-checkpoint-args --tensor-model-parallel-size 2 \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/ --port 5000

    curl -s localhost:5000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}' \
        -H 'Content-Type: application/json'

With data-parallel replicas (more ranks than tensor x pipeline x expert parallelism need),
each replica serves its share of the requests.

Endpoints: see `megatron_smp.inference.server`. Needs the `serve` extra (FastAPI, uvicorn).
--port 0 takes a free port; --port-file writes the port once the server listens.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.cli import run_entry  # noqa: E402
from megatron_smp.training.inference_flags import build_inference_engine  # noqa: E402


def add_server_args(parser):
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=5000,
                       help="port to listen on (0: a free one, written to --port-file)")
    group.add_argument("--port-file", default=None,
                       help="write the listening port here once the server is up")
    group.add_argument("--chat-template", default=None,
                       help="Jinja chat template (text or file) instead of the tokenizer's")
    group.add_argument("--served-model-name", default=None,
                       help="the model id of /v1/models (default: the --load directory name)")
    return parser


def main(argv=None):
    from megatron_smp.inference.server import serve  # the serve extra, checked on every rank
    from megatron_smp.inference.text import TextCodec
    from megatron_smp.parallel_state import destroy_parallel_state

    configs, state, engine, tokenizer = build_inference_engine(argv, add_server_args)
    args = configs.args
    codec = TextCodec(tokenizer, args.chat_template)
    if not engine.is_leader:
        engine.stop_checker = codec.stop_checker  # a data-parallel replica's leader checks
        engine.worker_loop()
        destroy_parallel_state()
        return
    name = args.served_model_name or os.path.basename(
        os.path.normpath(configs.checkpoint.load or "megatron_smp"))

    def ready(port):
        print(f"serving {name} on http://{args.host}:{port}", flush=True)
        if args.port_file:
            with open(args.port_file + ".tmp", "w") as handle:
                handle.write(str(port))
            os.replace(args.port_file + ".tmp", args.port_file)

    serve(engine, codec, name, args.host, args.port, ready)
    destroy_parallel_state()


if __name__ == "__main__":
    sys.exit(run_entry(main))
