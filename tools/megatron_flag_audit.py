"""Classify the flags of Megatron-LM's functional-test configs through our parser.

    python tools/megatron_flag_audit.py MEGATRON_LM/tests/functional_tests/test_cases/gpt \
        MEGATRON_LM/tests/functional_tests/test_cases/moe [--top 25]

Reads every `model_config.yaml` under the given folders (their `MODEL_ARGS`: `--flag: value`,
`true` for a switch) and sorts each distinct flag into
  * accepted: our parser takes it (of which: ignored, listed in IGNORED_FLAGS),
  * error: given alone, parse_args raises a ConfigError naming it (a capability not built),
  * unrecognised: argparse rejects it,
with the number of configs using each, then how many whole configs parse (flags only: no
data, no launch). A Megatron-LM checkout at core_v0.16.1 gives the figures of issue 15.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import sys
from typing import Dict, List, Optional, Tuple

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.config import ConfigError  # noqa: E402
from megatron_smp.training.arguments import IGNORED_FLAGS, build_parser, parse_args  # noqa: E402

# The smallest flag set parse_args needs, for trying one flag on its own.
_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--train-iters", "2", "--mock-data", "--vocab-size", "100"]


def config_argv(model_args: Dict[str, object]) -> List[str]:
    """MODEL_ARGS -> argv as Megatron's functional-test launcher passes it: `true` is the
    bare switch, `false` leaves the flag out, "[a b c]" is several values."""
    argv: List[str] = []
    for flag, value in model_args.items():
        if value is False or value is None:
            continue
        argv.append(str(flag))
        if value is True:
            continue
        text = str(value).strip()
        if text.startswith("[") and text.endswith("]"):
            argv += text[1:-1].replace(",", " ").split()
        else:
            argv.append(text)
    return argv


def try_parse(argv: List[str]) -> Tuple[str, Optional[str]]:
    """("ok" | "error" | "unrecognised", message) for parse_args(argv)."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_args(argv)
    except ConfigError as error:
        return "error", str(error)
    except SystemExit:
        return "unrecognised", stderr.getvalue().strip().splitlines()[-1]
    return "ok", None


def read_configs(folders: List[str], skip: Optional[str] = None) -> Dict[str, Dict[str, object]]:
    """MODEL_ARGS of each model_config.yaml under `folders`, by test name; names containing
    `skip` are left out."""
    configs = {}
    for folder in folders:
        for root, _, files in os.walk(folder):
            if skip and skip in os.path.basename(root):
                continue
            if "model_config.yaml" in files:
                path = os.path.join(root, "model_config.yaml")
                with open(path) as handle:
                    data = yaml.safe_load(handle) or {}
                if isinstance(data.get("MODEL_ARGS"), dict):
                    configs[os.path.relpath(root, os.path.dirname(folder))] = data["MODEL_ARGS"]
    return configs


def audit(folders: List[str], top: int = 25, skip: Optional[str] = None) -> dict:
    """The classification as plain data (see the module docstring)."""
    configs = read_configs(folders, skip)
    accepted_flags = {s for a in build_parser()._actions for s in a.option_strings}
    users: Dict[str, int] = collections.Counter()
    sample_value: Dict[str, List[str]] = {}
    for model_args in configs.values():
        for flag, value in model_args.items():
            users[str(flag)] += 1
            sample_value.setdefault(str(flag), config_argv({flag: value})[1:])
    classes: Dict[str, Dict[str, int]] = {"accepted": {}, "error": {}, "unrecognised": {}}
    messages = {}
    for flag, count in users.items():
        if flag in accepted_flags:
            classes["accepted"][flag] = count
            continue
        outcome, message = try_parse(_BASE + [flag] + sample_value[flag])
        kind = "error" if outcome == "error" and flag in message else "unrecognised"
        classes[kind][flag] = count
        messages[flag] = message
    parsed = collections.Counter(try_parse(config_argv(args))[0] for args in configs.values())
    ranked = {kind: sorted(flags.items(), key=lambda item: (-item[1], item[0]))
              for kind, flags in classes.items()}
    return {
        "configs": len(configs),
        "flags": len(users),
        "accepted": len(classes["accepted"]),
        "ignored": sorted(set(classes["accepted"]) & set(IGNORED_FLAGS)),
        "error": len(classes["error"]),
        "unrecognised": len(classes["unrecognised"]),
        "top_unrecognised": ranked["unrecognised"][:top],
        "top_error": [(flag, count, messages[flag]) for flag, count in ranked["error"][:top]],
        "configs_parsing": dict(parsed),
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="folders holding */model_config.yaml")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--skip", metavar="TEXT",
                        help="leave out tests whose name contains TEXT (e.g. inference)")
    args = parser.parse_args(argv)
    result = audit(args.folders, args.top, args.skip)
    print(f"{result['configs']} configs, {result['flags']} distinct flags: "
          f"{result['accepted']} accepted ({len(result['ignored'])} of them ignored), "
          f"{result['error']} clear errors, {result['unrecognised']} unrecognised")
    print(f"whole configs through parse_args: {result['configs_parsing']}")
    print("\nunrecognised (configs using it):")
    for flag, count in result["top_unrecognised"]:
        print(f"  {count:4d}  {flag}")
    print("\nclear errors (configs using it):")
    for flag, count, message in result["top_error"]:
        print(f"  {count:4d}  {flag}: {message[:110]}")


if __name__ == "__main__":
    main()
