"""Speculative decoding through the tools, on a checkpoint converted from a HF Llama:
tools/generate.py at TP=2 with a draft model from a checkpoint (--speculative-config, vLLM's
form) gives HF's greedy tokens and prints its drafted / accepted counts; the server with
n-gram speculation answers with HF's tokens and its /metrics (Prometheus text, fetched over
HTTP on 127.0.0.1) counts what it served; the flags' errors."""
import argparse
import json

import pytest
import torch

from megatron_smp.config import ConfigError
from tests.unit.inference.common import (
    convert_to_ours, hf_model_dir, launch, model_flags, server_url, stop, wait_all,
)

requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    hf, tokenizer = hf_model_dir(root / "hf")
    convert_to_ours(root / "hf", root / "ckpt")
    return root, hf, tokenizer


def _hf_greedy(hf, ids, new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_generate_tool_tp2_with_a_draft_checkpoint(checkpoint):
    root, hf, tokenizer = checkpoint
    texts = ["In the beginning God", "The quick brown fox jumps over the"]
    source, output = root / "prompts.jsonl", root / "completions.jsonl"
    source.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    config = {"method": "draft_model", "model": str(root / "ckpt"),
              "num_speculative_tokens": 3}
    flags = model_flags(root / "ckpt", root / "hf") + [
        "--tensor-model-parallel-size", "2", "--input", source, "--output", output,
        "--max-new-tokens", "8", "--ignore-eos", "--speculative-config", json.dumps(config)]
    procs = launch("generate.py", flags, 2, root)
    log = root / "rank0.log"
    assert wait_all(procs, 240) == [0, 0], log.read_text()[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    for record, text in zip(records, texts):
        assert record["tokens"] == _hf_greedy(hf, tokenizer.encode(text), 8)
    # the model drafting for itself: every draft accepted; 2 x (8 - 1) tokens after the
    # first ones, at most 3 drafts a step and never past max_new_tokens
    line = next(line for line in log.read_text().splitlines()
                if line.startswith("speculative decoding (draft_model)"))
    drafted = int(line.split(": ")[1].split(" tokens drafted")[0])
    assert "acceptance rate 1.000" in line and 0 < drafted <= 14, line


def test_generate_tool_data_parallel_replicas_with_ngram(checkpoint):
    """Two data-parallel replicas (2 ranks at TP=1): HF's tokens, and the drafted / accepted
    counts summed over both replicas' requests."""
    root, hf, tokenizer = checkpoint
    texts = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
             "And the earth was without form, and void; and darkness was upon the face"]
    source, output = root / "replicas.jsonl", root / "replicas_out.jsonl"
    source.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    flags = model_flags(root / "ckpt", root / "hf") + [
        "--input", source, "--output", output, "--max-new-tokens", "8", "--ignore-eos",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    procs = launch("generate.py", flags, 2, root)
    log = root / "rank0.log"
    assert wait_all(procs, 240) == [0, 0], log.read_text()[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    for record, text in zip(records, texts):
        assert record["tokens"] == _hf_greedy(hf, tokenizer.encode(text), 8)
    text = log.read_text()
    assert "requests per data-parallel replica: [1, 1]" in text
    line = next(line for line in text.splitlines()
                if line.startswith("speculative decoding (ngram)"))
    assert int(line.split(": ")[1].split(" tokens drafted")[0]) > 0, line


def _metrics(url):
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=30).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "le")
            if "le" in sample.labels:
                continue
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def test_server_ngram_speculation_and_metrics(checkpoint):
    root, hf, tokenizer = checkpoint
    port_file = root / "port"
    flags = model_flags(root / "ckpt", root / "hf") + [
        "--port", "0", "--port-file", port_file, "--inference-max-tokens", "512",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    procs = launch("run_text_generation_server.py", flags, 1, root)
    try:
        url = server_url(procs, port_file, root)
        before = _metrics(url)
        assert before["megatron_smp:num_requests_running"] == 0
        assert before["megatron_smp:kv_cache_blocks_total"] == 512 // 16
        text = "The quick brown fox jumps over the lazy dog. The quick brown fox"
        ids = tokenizer.encode(text)
        body = {"prompt": text, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        answer = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == tokenizer.decode(_hf_greedy(hf, ids, 10))
        body["max_tokens"] = 4
        requests.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
        after = _metrics(url)
    finally:
        codes = stop(procs)
    assert codes == [0] or codes[0] in (0, -15), (root / "rank0.log").read_text()[-2000:]
    assert after["megatron_smp:prompt_tokens_total"] == 2 * len(ids)
    assert after["megatron_smp:generation_tokens_total"] == 14
    assert after["megatron_smp:request_success_total{finished_reason=length}"] == 2
    assert after["megatron_smp:time_to_first_token_seconds_count"] == 2
    assert after["megatron_smp:time_per_output_token_seconds_count"] == 9 + 3
    assert after["megatron_smp:time_to_first_token_seconds_sum"] > 0
    assert after["megatron_smp:num_requests_running"] == 0
    assert after["megatron_smp:num_requests_waiting"] == 0
    assert after["megatron_smp:kv_cache_blocks_used"] == 0
    drafted = after["megatron_smp:spec_decode_num_draft_tokens_total"]
    accepted = after["megatron_smp:spec_decode_num_accepted_tokens_total"]
    assert drafted >= accepted > 0  # the repeated phrase is found in the prompt
    assert after["megatron_smp:spec_decode_acceptance_rate"] == pytest.approx(
        accepted / drafted)


def test_speculative_flag_errors(checkpoint):
    from megatron_smp.inference.speculative import speculative_config_of
    from megatron_smp.training.inference_flags import build_inference_engine

    def args(config=None, tokens=None):
        return argparse.Namespace(speculative_config=config, num_speculative_tokens=tokens)

    assert speculative_config_of(args()) is None
    assert speculative_config_of(args(tokens=2)).method == "mtp"
    for namespace, match in (
            (args('{"method": "ngram", "num_speculative_tokens": 2}', 2), "not both"),
            (args("{method"), "not JSON"),
            (args('{"method": "draft_model", "num_speculative_tokens": 2}'), '"model"'),
            (args('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}'),
             "goes with method 'draft_model'"),
            (args('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}'), "unknown keys"),
            (args(tokens=0), "num_speculative_tokens")):
        with pytest.raises(ConfigError, match=match):
            speculative_config_of(namespace)
    root, _, _ = checkpoint
    with pytest.raises(ConfigError, match="mtp-num-layers"):  # before any process group
        build_inference_engine(model_flags(root / "ckpt", root / "hf")
                               + ["--num-speculative-tokens", "2"])


def test_bench_speculative_rows(checkpoint):
    """tools/bench/bench_speculative.py: a row per method with its tokens checked equal to
    plain decoding's; the model drafting for itself accepts every draft."""
    import subprocess
    import sys

    from tests.unit.inference.common import CORPUS, ROOT

    root, _, _ = checkpoint
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n"
                              for line in CORPUS.split(". ") * 2))
    command = [sys.executable, f"{ROOT}/tools/bench/bench_speculative.py",
               *model_flags(root / "ckpt", root / "hf"), "--draft-load", str(root / "ckpt"),
               "--prompts", str(corpus), "--prompt-tokens", "6", "--new", "6",
               "--requests", "3", "--batch1-prompts", "2", "--num-drafts", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("plain", "ngram", "draft_model")}
    assert set(rows) == {"plain", "ngram", "draft_model"}
    assert rows["draft_model"][3] == "1.000" and rows["draft_model"][6] == "1.000"
    assert "tokens: every method's equal" in done.stdout
