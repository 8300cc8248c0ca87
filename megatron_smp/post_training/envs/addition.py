"""Two-number addition: a synthetic task with an exact-match reward, small enough for a model
that trains on a CPU.

    python -m megatron_smp.post_training.envs.addition --output data/rl/addition_train.jsonl \
        --num-prompts 2000 --seed 1 [--format sft]

writes `{"prompt": "37+45=", "answer": "82"}` records (`--format sft`: `{"prompt", "response"}`
for tools/preprocess_sft_data.py, the response being the answer and a newline). The environment
config `addition.yaml` beside this file generates its prompts in memory from `prompts`.
"""
import argparse
import json
import random
from typing import Any, Dict, List


def prompts(num_prompts: int = 1000, digits: int = 2, seed: int = 0) -> List[Dict[str, Any]]:
    """`num_prompts` records {"prompt": "a+b=", "answer": str(a + b)}, operands of `digits`
    digits, the same list for the same seed."""
    if num_prompts <= 0 or digits <= 0:
        raise ValueError(f"addition.prompts: num_prompts ({num_prompts}) and digits ({digits}) "
                         f"must be positive")
    generator = random.Random(seed)
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    records = []
    for _ in range(num_prompts):
        a, b = generator.randint(low, high), generator.randint(low, high)
        records.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return records


def first_line(completion: str) -> str:
    """The answer part of a completion: its first line, stripped (generation may run on)."""
    return completion.strip().split("\n", 1)[0].strip() if completion.strip() else ""


def exact_match(prompt: str, completion: str, answer: Any) -> float:
    """1.0 when the completion's first line is exactly the answer, else 0.0."""
    return 1.0 if first_line(completion) == str(answer) else 0.0


def digit_match(prompt: str, completion: str, answer: Any) -> float:
    """Fraction of the answer's digits right in place (a denser signal than exact match)."""
    guess, answer = first_line(completion), str(answer)
    if not answer:
        return 0.0
    right = sum(1 for g, a in zip(guess, answer) if g == a)
    return right / max(len(answer), len(guess))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=["rl", "sft"], default="rl",
                        help="rl: {prompt, answer} (for --langrl-env-config); "
                             "sft: {prompt, response} (for tools/preprocess_sft_data.py)")
    args = parser.parse_args(argv)
    with open(args.output, "w", encoding="utf-8") as handle:
        for record in prompts(args.num_prompts, args.digits, args.seed):
            if args.format == "sft":
                record = {"prompt": record["prompt"], "response": record["answer"] + "\n"}
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
