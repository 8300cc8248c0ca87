"""The backend API: `compute_logprobs` equals HF's log_softmax(...).gather(...) (and its
entropy) on the same weights at TP=2 (+SP), PP=2, CP=2, EP=2 and FSDP2, packed and unpacked;
`iter_hf_weights` gives `hf_state_dict()` tensor for tensor, with a measured peak above the
model within twice the largest tensor."""
import pytest
import torch

from megatron_smp.testing import run_distributed
from tests.unit.models.common import to_numpy

VOCAB = 96
SEQ = 16
LLAMA = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --ffn-hidden-size 64 --max-position-embeddings 64 "
         "--normalization RMSNorm --swiglu --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 "
         f"--attention-dropout 0 --seq-length {SEQ} --micro-batch-size 1 --global-batch-size 2 "
         "--train-iters 1 --lr 1e-3 --seed 5 --mock-data").split()
MOE = "--num-experts 4 --moe-router-topk 2".split()


def build(argv):
    """(configs, state, model chunks) as training builds them."""
    import pretrain_gpt
    from megatron_smp.parallel_state import build_parallel_state
    from megatron_smp.tensor_parallel.random import model_parallel_seed
    from megatron_smp.training.arguments import parse_args, validate_configs
    from megatron_smp.training.pretrain import build_model_chunks

    configs = parse_args(argv)
    configs.model.vocab_size = VOCAB
    validate_configs(configs)
    state = build_parallel_state(configs.parallel)
    model_parallel_seed(configs.training.seed, state)
    return configs, state, build_model_chunks(pretrain_gpt.model_provider, configs, state)


def _batch(packed):
    """Two rows of SEQ + 1 tokens; packed: documents of 6, 4 and 6 positions per row."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:]}
    if packed:
        from megatron_smp.data.gpt_dataset import document_ids_and_position_ids

        positions, documents = document_ids_and_position_ids([0, 6, 10], SEQ, True, True)
        batch["position_ids"] = positions.expand(2, SEQ).clone()
        batch["document_ids"] = documents.expand(2, SEQ).clone()
    return ids, batch


def _hf_reference(hf, ids, batch, temperature=1.0):
    """HF's per-token log-probs and entropy, each packed document run on its own."""
    documents = batch.get("document_ids")
    logits = torch.zeros(ids.shape[0], SEQ, VOCAB)
    with torch.no_grad():
        if documents is None:
            logits = hf(ids[:, :-1]).logits.float()
        else:
            for row in range(ids.shape[0]):
                for number in documents[row].unique():
                    where = (documents[row] == number).nonzero().flatten()
                    logits[row, where] = hf(ids[row:row + 1, where]).logits[0].float()
    log_probs = torch.log_softmax(logits / temperature, -1)
    return (log_probs.gather(-1, batch["labels"][..., None])[..., 0],
            -(log_probs.exp() * log_probs).sum(-1))


def _logprobs_worker(rank, world_size, flags, family):
    from megatron_smp.models.hf import config_to_hf
    from megatron_smp.post_training.backend_api import compute_logprobs, iter_hf_weights
    import transformers

    configs, state, chunks = build(LLAMA + flags)
    weights = dict(iter_hf_weights(chunks, state, configs.model, family, device="cpu"))
    hf_config = config_to_hf(configs.model, family)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    diffs = []
    for packed in (False, True):
        if packed and "--context-parallel-size" in flags and "all_gather" not in flags:
            continue
        ids, batch = _batch(packed)
        out = compute_logprobs(chunks, batch, state, VOCAB, micro_batch_size=1,
                               with_entropy=True)
        logps, entropy = _hf_reference(hf, ids, batch)
        diffs.append((packed, float((out["logprobs"] - logps).abs().max()),
                      float((out["entropy"] - entropy).abs().max())))
    # Sampling's temperature: the logits divided by it.
    out = compute_logprobs(chunks, batch, state, VOCAB, micro_batch_size=2, temperature=0.7)
    logps, _ = _hf_reference(hf, ids, batch, temperature=0.7)
    diffs.append(("temperature 0.7", float((out["logprobs"] - logps).abs().max()), 0.0))
    return diffs, to_numpy(weights), _token_budget_diff(chunks, state, flags)


def _token_budget_diff(chunks, state, flags):
    """Token-budget micro-batches against fixed ones of one row: the largest difference on
    the real positions, the largest value past them (0), and the micro-batch count. Where the
    data-parallel ranks may hold different rows (EP=2, FSDP2), rank 1's rows are longer, so
    the ranks' counts differ (3 and 4) and the shorter list is padded."""
    from megatron_smp.post_training.backend_api import compute_logprobs, token_budget_microbatches

    ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(4))
    lengths = [16, 5, 9, 12]
    if state.dp_size > 1 and state.rank == 1:
        lengths = [16, 16, 15, 14]
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "lengths": torch.tensor(lengths)}
    fixed = compute_logprobs(chunks, batch, state, VOCAB, micro_batch_size=1,
                             with_entropy=True)
    budget = compute_logprobs(chunks, batch, state, VOCAB, max_tokens_per_microbatch=24,
                              with_entropy=True)
    real = torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]
    diff = max(float((budget[key] - fixed[key])[real].abs().max()) for key in fixed)
    past = max(float(budget[key][~real].abs().max()) for key in fixed)
    multiple = 4 if "--context-parallel-size" in flags else 2 if "--sequence-parallel" in flags \
        else 1
    return diff, past, len(token_budget_microbatches(lengths, 24, multiple, SEQ))


_SINGLE = {}


def _single_process(family):
    """The one-process run of a family (computed once, shared by the layouts)."""
    if family not in _SINGLE:
        extra = MOE if family == "mixtral" else []
        _SINGLE[family], = run_distributed(_logprobs_worker, 1, args=(extra, family),
                                           timeout=240)
    return _SINGLE[family]


@pytest.mark.parametrize("flags,family", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", "llama"),
    ("--pipeline-model-parallel-size 2", "llama"),
    ("--context-parallel-size 2 --cp-comm-type all_gather", "llama"),
    ("--expert-model-parallel-size 2 " + " ".join(MOE), "mixtral"),
    ("--use-torch-fsdp2", "llama"),  # the stream gathers FSDP2's row shards
])
def test_compute_logprobs_equals_hf_at_every_layout(flags, family):
    """Every rank gets the whole sequences' log-probs and entropies, equal to HF's on the
    weights the stream gives (1e-5, fp32), packed and unpacked; the streamed weights equal
    the single process's (the same seed builds the same model at every layout)."""
    results = run_distributed(_logprobs_worker, 2, args=(flags.split(), family), timeout=240)
    single_diffs, single_weights, single_budget = _single_process(family)
    for diffs, weights, (budget_diff, past, count) in results + [
            (single_diffs, single_weights, single_budget)]:
        assert len(diffs) == 3, diffs  # packed and unpacked, and with a temperature
        for packed, logps_diff, entropy_diff in diffs:
            assert logps_diff < 1e-5 and entropy_diff < 1e-5, (flags, packed, diffs)
        assert sorted(weights) == sorted(single_weights)
        for name, tensor in weights.items():
            assert (tensor == single_weights[name]).all(), (flags, name)
        # Token-budget micro-batches ([16], [12, 9], [5] of 24 tokens) equal fixed ones.
        assert budget_diff < 1e-5 and past == 0.0 and count in (3, 4), (flags, budget_diff)
    if "--use-torch-fsdp2" in flags or "--expert-model-parallel-size" in flags:
        assert [count for _, _, (_, _, count) in results] == [3, 4]


def _stream_worker(rank, world_size, layout, lora):
    """iter_hf_weights against hf_state_dict of a transformed model (TP / EP, LoRA)."""
    import transformers

    import megatron_smp.smp as smp
    from megatron_smp.post_training.backend_api import iter_hf_weights

    torch.manual_seed(0)
    if "expert_parallel_degree" in layout:
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2))
    smp.init(dict(layout))
    model = smp.transform(hf)
    if lora:
        model.apply_lora(rank=4, alpha=8)
        with torch.no_grad():  # B = 0 would hide a wrong merge
            for name, param in model.named_parameters():
                if name.endswith("lora_B"):
                    param.normal_()
    expected = model.hf_state_dict()
    streamed = list(iter_hf_weights(model.module, model.module.state,
                                    model.transformer_config, model.family, lora=model.lora))
    names = [name for name, _ in streamed]
    return (sorted(names) == sorted(expected), len(names) == len(set(names)),
            all(torch.equal(tensor, expected[name]) for name, tensor in streamed))


@pytest.mark.parametrize("layout,lora", [({"tensor_parallel_degree": 2}, True),
                                         ({"expert_parallel_degree": 2}, False)])
def test_iter_hf_weights_reproduces_hf_state_dict(layout, lora):
    for same_names, unique, equal in run_distributed(_stream_worker, 2, args=(layout, lora),
                                                     timeout=240):
        assert same_names and unique and equal


PEAK_SCRIPT = r"""
import re, sys, torch, transformers
from megatron_smp.distributed.param_and_grad_buffer import map_large_host_allocations
map_large_host_allocations(1 << 16)   # freed tensors go back to the OS: RSS follows live memory
import megatron_smp.smp as smp
from megatron_smp.post_training.backend_api import iter_hf_weights

def rss(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=16000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2))
smp.init({})
model = smp.transform(hf)
del hf
largest = max(p.numel() * p.element_size() for p in model.parameters())

def stream():
    total = 0
    for name, tensor in iter_hf_weights(model.module, model.module.state,
                                        model.transformer_config, model.family):
        total += tensor.numel() * tensor.element_size()
        del tensor
    return total

stream()   # the first pass imports modules and warms the interpreter's own heap
open("/proc/self/clear_refs", "w").write("5")   # reset the peak RSS
before = rss("VmRSS")
total = stream()
print(rss("VmHWM") - before, largest, total)
"""


def test_iter_hf_weights_peak_memory_is_about_one_tensor(tmp_path):
    """Peak RSS above the model while streaming every tensor (one process; fresh
    interpreter, glibc returning freed tensors at once; the second pass, after the first
    has imported what it needs) stays within 2x the largest tensor (the 16000 x 256
    embedding, 16.4 MB: gathered, then converted)."""
    import subprocess
    import sys

    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, env={"OMP_NUM_THREADS": "1", "PATH": ""}, check=True)
    peak, largest, total = map(int, out.stdout.split()[-3:])
    print(f"peak above the model {peak / 1e6:.1f} MB, largest tensor {largest / 1e6:.1f} MB, "
          f"streamed {total / 1e6:.1f} MB")
    assert total > 2 * largest  # the stream holds much more than what it keeps at once
    assert peak < 2 * largest, (peak, largest)


def test_token_budget_grouping_and_errors():
    """Longest first, each micro-batch within the budget at its longest row's (rounded)
    width; a row wider than the budget, both sizes at once, or packed rows: errors naming
    what to change (raised before any collective)."""
    from megatron_smp.config import ConfigError
    from megatron_smp.post_training.backend_api import compute_logprobs, token_budget_microbatches

    assert token_budget_microbatches([16, 5, 9, 12], 24, 1, 16) == [([0], 16), ([3, 2], 12),
                                                                    ([1], 5)]
    assert token_budget_microbatches([3, 3, 3, 3, 1], 16, 4, 16) == [([0, 1, 2, 3], 4),
                                                                     ([4], 4)]
    with pytest.raises(ConfigError, match="max_tokens_per_microbatch=8 is less than row 0's "
                                          "12 positions; raise it to at least 12"):
        token_budget_microbatches([11, 2], 8, 4, 16)
    with pytest.raises(ConfigError, match="row 1 has length 0"):
        token_budget_microbatches([4, 0], 8, 1, 16)
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long),
             "labels": torch.zeros(2, 8, dtype=torch.long)}
    with pytest.raises(ConfigError, match="give micro_batch_size or max_tokens_per_microbatch"):
        compute_logprobs(None, batch, None, VOCAB, micro_batch_size=1,
                         max_tokens_per_microbatch=8)
    with pytest.raises(ConfigError, match="rows with document_ids .* give micro_batch_size"):
        compute_logprobs(None, dict(batch, document_ids=batch["tokens"]), None, VOCAB,
                         max_tokens_per_microbatch=8)
