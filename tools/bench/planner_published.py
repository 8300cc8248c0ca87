"""The step-time planner against published runs: each row of
tests/fixtures/published_runs/published_runs.json (exact layouts and the throughput their
sources report) predicted with the GPU efficiency constants, published vs predicted tokens/s
per GPU and their ratio (the README's table).

    python tools/bench/planner_published.py [--json out.json] [--markdown]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

FIXTURE = os.path.join(REPO, "tests", "fixtures", "published_runs", "published_runs.json")


def predict_row(row: dict, efficiency=None):
    """The planner's prediction for one fixture row (no memory: the layouts ran)."""
    from plan import build_parser, load_configs

    from megatron_smp.training import planner

    ours, flags = build_parser().parse_known_args(
        ["--gpu", row["gpu"], "--num-gpus", str(row["num_gpus"]), "--entry", row["entry"]]
        + row["flags"])
    configs, model_provider = load_configs(ours, flags)
    cluster = planner.Cluster(planner.GPUS[row["gpu"]], row["num_gpus"],
                              efficiency=efficiency or planner.GPU_EFFICIENCY)
    options = planner.PlanOptions(**row.get("options", {}))
    return planner.predict(configs, cluster, model_provider, options, memory=False)


def evaluate(path: str = FIXTURE, efficiency=None) -> list:
    with open(path) as f:
        fixture = json.load(f)
    out = []
    for row in fixture["rows"]:
        p = predict_row(row, efficiency)
        out.append({"source": row["source"], "name": row["name"], "gpu": row["gpu"],
                    "num_gpus": row["num_gpus"], "layout": p.layout.name(),
                    "published": row["tokens_per_s_per_gpu"],
                    "predicted": p.tokens_per_second_per_gpu,
                    "ratio": p.tokens_per_second_per_gpu / row["tokens_per_s_per_gpu"],
                    "breakdown_ms": {k: round(v * 1e3, 2) for k, v in p.breakdown.items()}})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    rows = evaluate()
    if args.markdown:
        print("| source | model | GPUs | layout | published tok/s/GPU | predicted | ratio |")
        print("|---|---|---:|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['source']} | {r['name']} | {r['num_gpus']} {r['gpu']} | {r['layout']} | "
                  f"{r['published']:,.0f} | {r['predicted']:,.0f} | {r['ratio']:.2f} |")
    else:
        for r in rows:
            print(f"{r['source'][:24]:<24} {r['name']:<18} {r['num_gpus']:>5} "
                  f"{r['layout']:<44} {r['published']:>9,.0f} {r['predicted']:>9,.0f} "
                  f"{r['ratio']:>5.2f}  " + " ".join(f"{k}={v:.0f}" for k, v in
                                                   r["breakdown_ms"].items() if v))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
