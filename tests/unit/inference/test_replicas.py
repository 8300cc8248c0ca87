"""Data-parallel replicas and Megatron-LM checkpoints in the inference tools: tools/generate.py
at DP=2 over a real Megatron-LM legacy checkpoint saved at TP=2 (tests/fixtures/megatron),
and tools/run_text_generation_server.py at DP=2 over a real megatron-core 0.19.2 torch_dist
one. Both replicas serve requests, the outputs come back in input order, and every greedy
generation equals Hugging Face `generate` on the same checkpoint converted to HF."""
import concurrent.futures
import contextlib
import io
import json
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_smp.checkpointing import CheckpointError
from tests.unit.inference.common import launch, server_url, stop, wait_all

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                        "fixtures", "megatron")
# The fixtures' tokenizer: NullTokenizer over 99 ids + eod (the checkpoint's args give the
# model's shape: --use-checkpoint-args).
FLAGS = ["--use-checkpoint-args", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]
PROMPTS = [[5, 17, 42, 3], [9, 8, 7, 6, 5, 4], [1, 2, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19],
           [50, 60, 70]]
NEW = [5, 5, 5, 5, 2]


def _hf(fixture, tmp_path):
    from transformers import AutoModelForCausalLM

    from tools.checkpoint.convert import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["--model-type", "llama", "--loader", "megatron", "--saver", "hf",
                     "--load-dir", os.path.join(FIXTURES, fixture),
                     "--save-dir", str(tmp_path / "hf")]) == 0
    return AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()


def _hf_greedy(hf, prompt, new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_generate_tool_dp2_from_megatron_legacy_checkpoint(tmp_path):
    source, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": n}) + "\n"
                              for p, n in zip(PROMPTS, NEW)))
    procs = launch("generate.py", ["--load", os.path.join(FIXTURES, "llama_legacy_tp2_0192"),
                                   *FLAGS, "--input", source, "--output", output,
                                   "--ignore-eos"], 2, tmp_path)
    hf = _hf("llama_legacy_tp2_0192", tmp_path)  # meanwhile
    assert wait_all(procs, 180) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    log = (tmp_path / "rank0.log").read_text()
    assert "Megatron-LM 'torch' checkpoint" in log
    assert "requests per data-parallel replica: [3, 2]" in log
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(len(PROMPTS)))
    assert [r["prompt_ids"] for r in records] == PROMPTS
    for record, prompt, new in zip(records, PROMPTS, NEW):
        assert record["tokens"] == _hf_greedy(hf, prompt, new)


def test_server_dp2_from_megatron_torch_dist_checkpoint(tmp_path):
    requests = pytest.importorskip("requests")
    pytest.importorskip("fastapi")
    port_file = tmp_path / "port"
    procs = launch("run_text_generation_server.py",
                   ["--load", os.path.join(FIXTURES, "llama_torch_dist_0192"), *FLAGS,
                    "--port", "0", "--port-file", port_file], 2, tmp_path)
    try:
        hf = _hf("llama_torch_dist_0192", tmp_path)  # meanwhile
        url = server_url(procs, port_file, tmp_path)

        def ask(index):
            body = {"prompt": PROMPTS[index], "max_tokens": NEW[index], "temperature": 0,
                    "ignore_eos": True, "logprobs": 0}
            return requests.post(f"{url}/v1/completions", json=body, timeout=60).json()

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, range(len(PROMPTS))))
        for answer, prompt, new in zip(answers, PROMPTS, NEW):
            tokens = [int(t) for t in answer["choices"][0]["logprobs"]["tokens"]]
            assert tokens == _hf_greedy(hf, prompt, new)
        served = requests.get(f"{url}/health", timeout=30).json()["replicas"]
        assert sum(served) == len(PROMPTS) and min(served) >= 1
        bad = requests.post(f"{url}/v1/completions", json={"prompt": [1], "top_k": -5},
                            timeout=30)
        assert bad.status_code == 400 and "top_k" in bad.json()["error"]["message"]
        # a streamed completion: its chunks add up to the text of the whole one
        body = {"prompt": PROMPTS[3], "max_tokens": NEW[3], "temperature": 0,
                "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True,
                           timeout=60) as response:
            events = [line[6:] for line in response.iter_lines(decode_unicode=True)
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
        assert "".join(c["text"] for c in chunks) == answers[3]["choices"][0]["text"]
        assert chunks[-1]["finish_reason"] == "length"
    finally:
        codes = stop(procs)
    assert codes[1] == 0, (tmp_path / "rank1.log").read_text()[-2000:]


def test_ckpt_format_torch_refuses_a_torch_dist_checkpoint():
    """--ckpt-format is checked as training checks it, before anything is read."""
    from megatron_smp.checkpointing.loop import load_inference_weights

    checkpoint = SimpleNamespace(load=os.path.join(FIXTURES, "llama_torch_dist_0192"),
                                 ckpt_format="torch", auto_detect_ckpt_format=False)
    with pytest.raises(CheckpointError, match="--auto-detect-ckpt-format"):
        load_inference_weights(None, None, SimpleNamespace(checkpoint=checkpoint))
