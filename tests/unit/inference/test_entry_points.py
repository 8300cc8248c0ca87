"""tools/generate.py at PP=2 on a checkpoint converted from HF: HF's greedy tokens, prompts as
text, token ids and chat messages; and tools/run_text_generation_server.py at TP=2 (two
processes, rank 0 serving on 127.0.0.1, prefix caching on) over a checkpoint converted from a
HF Llama with a byte-level BPE tokenizer: the real `openai`
client gets completions (HF's greedy tokens), chat completions (the chat template) and a
streamed completion; 16 concurrent clients are all answered; bad requests get their 400 and
the next request succeeds; Megatron's PUT /api; lm-evaluation-harness scores the shipped local
tasks through the server exactly as its own `hf` backend does on the HF weights
(`local-completions` for log-likelihoods and generation, `local-chat-completions` for
generation through the chat template). The server
always shuts down (SIGTERM, then SIGKILL)."""
import concurrent.futures
import json
import os

import pytest
import torch

from tests.unit.inference.common import (
    ROOT, convert_to_ours, hf_model_dir, launch, model_flags, server_url, stop, wait_all,
)

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, HF model, tokenizer): the HF model in root/hf, converted in root/ckpt."""
    root = tmp_path_factory.mktemp("inference")
    hf, tokenizer = hf_model_dir(root / "hf")
    convert_to_ours(root / "hf", root / "ckpt")
    return root, hf, tokenizer


def test_generate_tool_pp2_matches_hf(checkpoint):
    root, hf, tokenizer = checkpoint
    lines = [{"prompt": "In the beginning God"},
             {"prompt_ids": tokenizer.encode("The quick brown"), "max_new_tokens": 3},
             {"messages": [{"role": "user", "content": "What is two plus two?"}]},
             {"prompt": "And the earth", "temperature": 1.0, "seed": 3}]
    source, output = root / "prompts.jsonl", root / "completions.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = model_flags(root / "ckpt", root / "hf") + [
        "--pipeline-model-parallel-size", "2", "--input", source, "--output", output,
        "--max-new-tokens", "6", "--ignore-eos"]
    procs = launch("generate.py", flags, 2, root)
    assert wait_all(procs, 180) == [0, 0], (root / "rank0.log").read_text()[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    chat = tokenizer.apply_chat_template(lines[2]["messages"], tokenize=False,
                                         add_generation_prompt=True)
    for record, text, new in ((records[0], "In the beginning God", 6),
                              (records[1], "The quick brown", 3), (records[2], chat, 6)):
        expected = _hf_greedy(hf, tokenizer, text, new)
        assert record["tokens"] == expected and record["finish_reason"] == "length"
        assert record["completion"] == tokenizer.decode(expected)
    assert len(records[3]["tokens"]) == 6 and len(records[3]["logprobs"]) == 6


@pytest.fixture(scope="module")
def server(checkpoint):
    root, hf, tokenizer = checkpoint
    port_file = root / "port"
    flags = model_flags(root / "ckpt", root / "hf") + [
        "--tensor-model-parallel-size", "2", "--port", "0", "--port-file", port_file,
        "--inference-max-seq-length", "96", "--inference-max-tokens", "2048",
        "--inference-dynamic-batching-prefix-caching",
        "--inference-dynamic-batching-prefix-caching-eviction-policy", "lru"]
    procs = launch("run_text_generation_server.py", flags, 2, root)
    try:
        yield server_url(procs, port_file, root), hf, tokenizer, root
    finally:
        codes = stop(procs)
    assert codes[1] == 0, (root / "rank1.log").read_text()[-2000:]  # released by rank 0


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _hf_greedy(hf, tokenizer, text, new):
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_openai_client_completions_chat_and_stream(server):
    url, hf, tokenizer, _ = server
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["ckpt"]
    assert requests.get(f"{url}/health").json()["status"] == "ok"
    text = "In the beginning God"
    expected = _hf_greedy(hf, tokenizer, text, 6)
    result = client.completions.create(model="ckpt", prompt=text, max_tokens=6, temperature=0,
                                       logprobs=1)
    choice = result.choices[0]
    assert choice.finish_reason == "length" and result.usage.completion_tokens == 6
    assert choice.text == tokenizer.decode(expected)
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected]
    # echo: the prompt's log-probs are HF's
    echoed = client.completions.create(model="ckpt", prompt=text, max_tokens=0, echo=True,
                                       logprobs=1, temperature=0).choices[0]
    ids = tokenizer.encode(text)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1], dim=-1)
    reference = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert echoed.text == text and echoed.logprobs.token_logprobs[0] is None
    assert (torch.tensor(echoed.logprobs.token_logprobs[1:]) - reference).abs().max() < 1e-4
    # chat: the template's prompt
    messages = [{"role": "user", "content": "What is two plus two?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|user|>")
    chat = client.chat.completions.create(model="ckpt", messages=messages, max_tokens=5,
                                          temperature=0)
    expected_chat = hf.generate(torch.tensor([tokenizer.encode(prompt)]), max_new_tokens=5,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    assert chat.choices[0].message.content == tokenizer.decode(expected_chat[0, -5:])
    # streaming: the chunks add up to the whole completion
    pieces, reasons = [], []
    for chunk in client.completions.create(model="ckpt", prompt=text, max_tokens=6,
                                           temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == choice.text and reasons[-1] == "length" and len(pieces) > 2
    # sampled with a seed: reproducible; n choices
    sampled = [client.completions.create(model="ckpt", prompt=text, max_tokens=5,
                                         temperature=1.0, top_p=0.9, seed=7, n=2)
               for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert len(sampled[0].choices) == 2


def test_sixteen_concurrent_clients_and_bad_requests(server):
    url, hf, tokenizer, _ = server
    prompts = [f"The quick brown fox {'jumps ' * (i % 5)}" for i in range(16)]

    def ask(prompt):
        return _client(url).completions.create(model="ckpt", prompt=prompt, max_tokens=4,
                                               temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts[:3], answers[:3]):
        assert answer == tokenizer.decode(_hf_greedy(hf, tokenizer, prompt, 4))
    # (prefix caching, lru) the clients' common prefix was read from the cache, not computed
    assert requests.get(f"{url}/health").json()["cache"]["cached_prompt_tokens"] > 0
    completions = f"{url}/v1/completions"
    bad = [
        (dict(data="{not json", headers={"Content-Type": "application/json"}), "JSON"),
        (dict(json={"prompt": "x", "max_tokens": 2, "temperature": -1}), "temperature"),
        (dict(json={"prompt": "x", "max_tokens": 2, "frobnicate": True}), "frobnicate"),
        (dict(json={"prompt": "God " * 100, "max_tokens": 2}), "longer than the context"),
        (dict(json={"prompt": "x", "max_tokens": 2, "model": "other"}), "not served"),
        (dict(json={"prompt": "x", "presence_penalty": 0.5}), "presence_penalty"),
    ]
    for kwargs, match in bad:
        response = requests.post(completions, timeout=30, **kwargs)
        assert response.status_code == 400 and match in response.json()["error"]["message"]
        good = requests.post(completions, json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    response = requests.post(f"{url}/v1/chat/completions", timeout=30,
                             json={"messages": [{"role": "user"}]})
    assert response.status_code == 400
    # Megatron's PUT /api: prompt + generation, log-probs of prompt and generated tokens
    api = requests.put(f"{url}/api", timeout=30, json={
        "prompts": ["In the beginning"], "tokens_to_generate": 3, "temperature": 0.0,
        "logprobs": True}).json()
    expected = _hf_greedy(hf, tokenizer, "In the beginning", 3)
    assert api["text"] == ["In the beginning" + tokenizer.decode(expected)]
    assert len(api["logprobs"][0]) == len(tokenizer.encode("In the beginning")) - 1 + 3
    assert requests.put(f"{url}/api", json={"prompts": ["x"], "beam_width": 2},
                        timeout=30).status_code == 400


def _task_dir(tmp):
    source = os.path.join(ROOT, "tests", "fixtures", "lm_eval")
    for name in ("smp_tiny_mc", "smp_tiny_gen"):
        text = open(os.path.join(source, f"{name}.yaml")).read()
        data = os.path.join(source, "smp_tiny_mc.jsonl")
        (tmp / f"{name}.yaml").write_text(text.replace("DATA_FILE", data))
    return tmp


def test_lm_eval_scores_equal_hf_backend(server, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    url, _, _, root = server
    tasks = TaskManager(include_path=str(_task_dir(tmp_path)), include_defaults=False)
    names = ["smp_tiny_mc", "smp_tiny_gen"]
    ours = lm_eval.simple_evaluate(
        model="local-completions", tasks=names, task_manager=tasks, batch_size=1,
        model_args=(f"model=ckpt,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                    f"tokenizer={root / 'hf'},num_concurrent=1,max_retries=1,"
                    "tokenized_requests=True"))
    reference = lm_eval.simple_evaluate(
        model="hf", tasks=names, task_manager=tasks, batch_size=1,
        model_args=f"pretrained={root / 'hf'},dtype=float32,device=cpu")
    compared = 0
    for task in names:
        for metric, value in reference["results"][task].items():
            if metric.endswith(",none") and "stderr" not in metric:
                assert ours["results"][task][metric] == pytest.approx(value), (task, metric)
                compared += 1
    assert compared == 3  # acc, acc_norm, exact_match
    # the per-document log-likelihoods behind the scores agree too
    for ours_doc, reference_doc in zip(ours["samples"]["smp_tiny_mc"],
                                       reference["samples"]["smp_tiny_mc"]):
        got = [float(r[0]) for r in ours_doc["filtered_resps"]]
        want = [float(r[0]) for r in reference_doc["filtered_resps"]]
        assert got == pytest.approx(want, abs=1e-3)
    generated = [doc["filtered_resps"] for doc in ours["samples"]["smp_tiny_gen"]]
    assert generated == [doc["filtered_resps"] for doc in reference["samples"]["smp_tiny_gen"]]
    assert any(text for (text,) in generated)


def test_lm_eval_chat_completions_generations_equal_hf_backend(server, tmp_path):
    """lm-eval's `local-chat-completions` (messages through our chat template) on the shipped
    generation task gives the same generations and score as its `hf` backend with
    apply_chat_template on the HF weights."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    url, _, _, root = server
    tasks = TaskManager(include_path=str(_task_dir(tmp_path)), include_defaults=False)
    names = ["smp_tiny_gen"]
    ours = lm_eval.simple_evaluate(
        model="local-chat-completions", tasks=names, task_manager=tasks, batch_size=1,
        apply_chat_template=True,
        model_args=f"model=ckpt,base_url={url}/v1/chat/completions,num_concurrent=2,"
                   "max_retries=1")
    reference = lm_eval.simple_evaluate(
        model="hf", tasks=names, task_manager=tasks, batch_size=1, apply_chat_template=True,
        model_args=f"pretrained={root / 'hf'},dtype=float32,device=cpu")
    generated = [doc["filtered_resps"] for doc in ours["samples"]["smp_tiny_gen"]]
    assert generated == [doc["filtered_resps"] for doc in reference["samples"]["smp_tiny_gen"]]
    assert sum(len(text) for (text,) in generated) > 0
    assert ours["results"]["smp_tiny_gen"]["exact_match,none"] == pytest.approx(
        reference["results"]["smp_tiny_gen"]["exact_match,none"])
