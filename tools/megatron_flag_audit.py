"""Classify the flags of Megatron-LM's functional-test configs, or of its whole argument
parser, through our parser.

    python tools/megatron_flag_audit.py MEGATRON_LM/tests/functional_tests/test_cases/gpt \
        MEGATRON_LM/tests/functional_tests/test_cases/moe [--top 25]
    python tools/megatron_flag_audit.py --arguments MEGATRON_LM/megatron/training/arguments.py

Reads every `model_config.yaml` under the given folders (their `MODEL_ARGS`: `--flag: value`,
`true` for a switch) and sorts each distinct flag into
  * accepted: our parser takes it (of which: ignored, listed in IGNORED_FLAGS),
  * error: given alone, parse_args raises a ConfigError naming it (a capability not built),
  * unrecognised: argparse rejects it,
with the number of configs using each, then how many whole configs parse (flags only: no
data, no launch). A Megatron-LM checkout at core_v0.16.1 gives the figures of issue 15.

`--arguments PATH` takes every flag Megatron-LM's own parser declares instead (a checkout's
arguments.py, or an installed megatron-core wheel's: 0.19.2 ships megatron/training; give
`--python` a Python >= 3.12 interpreter of a venv holding it)
(`add_megatron_arguments` of that arguments.py, which on Megatron-LM main also generates
flags from config dataclasses, so the file's text alone does not list them). The checkout is
imported in a child process with this interpreter; modules it needs that are not installed
here (Transformer Engine, triton, ...) are replaced by inert stand-ins there, since only the
parser is built. Each flag is tried with a value its Megatron declaration accepts.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_smp.cli import run_entry  # noqa: E402

from megatron_smp.config import ConfigError  # noqa: E402
from megatron_smp.training.arguments import IGNORED_FLAGS, build_parser, parse_args  # noqa: E402
from megatron_smp.training.arguments.flags import _reject_not_supported_yet  # noqa: E402

# The smallest flag set parse_args needs, for trying one flag on its own.
_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--train-iters", "2", "--mock-data", "--vocab-size", "100"]


# What Megatron's functional-test launcher puts for the configs' ${...} (paths are never read).
LAUNCHER_ENVIRONMENT = {"DATA_PATH": "/data", "DATA_CACHE_PATH": "/data/cache",
                        "CHECKPOINT_SAVE_PATH": "/ckpt", "CHECKPOINT_LOAD_PATH": "/ckpt",
                        "TENSORBOARD_PATH": "/tb", "WANDB_SAVE_PATH": "/wandb",
                        "WANDB_EXPERIMENT": "experiment", "REPEAT": "1"}


def config_argv(model_args: Dict[str, object]) -> List[str]:
    """MODEL_ARGS -> argv as Megatron's functional-test launcher passes it: `true` is the
    bare switch, `false` leaves the flag out, "[a b c]" is several values, ${NAME} is
    LAUNCHER_ENVIRONMENT's."""
    argv = _config_tokens(model_args)
    return [re.sub(r"\$\{(\w+)\}", lambda m: LAUNCHER_ENVIRONMENT.get(m.group(1), m.group(0)),
                   token) for token in argv]


def _config_tokens(model_args: Dict[str, object]) -> List[str]:
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


# Run in a child process: imports Megatron-LM's arguments module with stand-ins for the
# modules this machine lacks, builds its parser and prints its flags as JSON.
_MEGATRON_PARSER = r"""
import argparse, importlib.abc, importlib.machinery, json, sys, types, typing

class _StubMeta(type):
    # Stand-in classes: attributes, calls (a decorator returns what it decorates),
    # subscripts and | give stand-ins; isinstance against one is False.
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (), {})
    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _StubMeta("instance", (), {})
    def __getitem__(cls, item): return cls
    def __or__(cls, other): return cls
    def __ror__(cls, other): return cls
    def __iter__(cls): return iter(())

class _StubModule(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = "0.0.0"
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (), {})

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # Only imports made from Megatron's own files that nothing here can satisfy get a stand-in
    # (and their submodules): optional imports of torch and others keep failing as usual.
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top == "megatron":
            return None
        if isinstance(sys.modules.get(top), _StubModule):
            return importlib.machinery.ModuleSpec(name, self)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        if frame is None or "/megatron/" not in frame.f_code.co_filename:
            return None
        for finder in sys.meta_path:
            if finder is not self and finder.find_spec(name, path, target) is not None:
                return None
        if top == "triton":
            # torch probes for triton itself: let it find the truth (absent) first.
            import torch._inductor.codegen.triton, torch.utils.flop_counter
        return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec): return _StubModule(spec.name)
    def exec_module(self, module): pass

sys.meta_path.append(_Finder())
if not hasattr(typing, "override"):  # Python 3.12's; Megatron-LM main imports it
    typing.override = lambda function: function
from megatron.training import arguments
parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
flags = []
for action in parser._actions:
    for flag in action.option_strings:
        if flag.startswith("--") and flag != "--help":
            flags.append({"flag": flag, "nargs": action.nargs,
                          "choices": [str(c) for c in action.choices or []],
                          "type": getattr(action.type, "__name__", None)})
sys.stdout.write("\nFLAGS_JSON " + json.dumps(flags) + "\n")
"""


def megatron_parser_flags(arguments_path: str, python: Optional[str] = None) -> List[dict]:
    """Every `--flag` Megatron-LM's parser declares (see the module docstring), as
    {"flag", "nargs", "choices", "type"} dicts, from its `megatron/training/arguments.py`
    (a checkout's, or an installed megatron-core wheel's), imported by `python` (default:
    this interpreter; megatron-core >= 0.17 needs Python >= 3.12)."""
    arguments_path = os.path.abspath(arguments_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(arguments_path)))
    if not os.path.isfile(arguments_path) or not os.path.isdir(os.path.join(root, "megatron")):
        raise SystemExit(f"--arguments {arguments_path}: expected megatron/training/arguments.py "
                         "inside a Megatron-LM checkout or a megatron-core wheel's site-packages")
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([python or sys.executable, "-c", _MEGATRON_PARSER], capture_output=True,
                          text=True, env=env, cwd=root, timeout=600)
    marker = "\nFLAGS_JSON "
    if proc.returncode != 0 or marker not in proc.stdout:
        raise SystemExit(f"could not build Megatron-LM's parser from {arguments_path}:\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.rsplit(marker, 1)[1])


def _sample_argv(spec: dict) -> List[str]:
    """The flag with a value its Megatron declaration accepts (none for a switch)."""
    nargs = spec["nargs"]
    if nargs == 0:
        return [spec["flag"]]
    if spec["choices"]:
        value = spec["choices"][0]
    else:
        value = {"int": "1", "float": "1.0"}.get(spec["type"], "1")
    count = nargs if isinstance(nargs, int) else 1
    return [spec["flag"]] + [value] * count


def audit_parser(specs: List[dict]) -> dict:
    """Megatron's parser flags sorted into accepted (of which ignored), clear errors (a
    ConfigError naming the flag) and missing (argparse rejects it)."""
    accepted_flags = {s for a in build_parser()._actions for s in a.option_strings}
    classes: Dict[str, List[str]] = {"accepted": [], "error": [], "missing": []}
    messages = {}
    for spec in specs:
        flag = spec["flag"]
        if flag in accepted_flags:
            classes["accepted"].append(flag)
            continue
        try:  # parse_args's first check: flags refused whatever else is given
            _reject_not_supported_yet(_sample_argv(spec))
        except ConfigError as error:
            outcome, message = "error", str(error)
        else:
            outcome, message = try_parse(_BASE + _sample_argv(spec))
        kind = "error" if outcome == "error" and flag in message else "missing"
        classes[kind].append(flag)
        messages[flag] = message
    return {
        "flags": len(specs),
        "accepted": sorted(classes["accepted"]),
        "ignored": sorted(set(classes["accepted"]) & set(IGNORED_FLAGS)),
        "error": {flag: messages[flag] for flag in sorted(classes["error"])},
        "missing": sorted(classes["missing"]),
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", help="folders holding */model_config.yaml")
    parser.add_argument("--arguments", metavar="PATH",
                        help="Megatron-LM's megatron/training/arguments.py: audit every flag "
                        "its parser declares instead")
    parser.add_argument("--python", metavar="PATH",
                        help="with --arguments: the interpreter that imports Megatron-LM "
                        "(megatron-core >= 0.17 needs Python >= 3.12)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--skip", metavar="TEXT",
                        help="leave out tests whose name contains TEXT (e.g. inference)")
    args = parser.parse_args(argv)
    if args.arguments:
        if args.folders:
            parser.error("give folders or --arguments, not both")
        result = audit_parser(megatron_parser_flags(args.arguments, args.python))
        print(f"{result['flags']} flags in Megatron-LM's parser: {len(result['accepted'])} "
              f"accepted ({len(result['ignored'])} of them ignored), {len(result['error'])} "
              f"clear errors, {len(result['missing'])} missing")
        print("\nclear errors:")
        for flag, message in result["error"].items():
            print(f"  {flag}: {message[:110]}")
        print(f"\nmissing (first {args.top}):")
        for flag in result["missing"][:args.top]:
            print(f"  {flag}")
        return
    if not args.folders:
        parser.error("give folders holding */model_config.yaml, or --arguments PATH")
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
    sys.exit(run_entry(main))
