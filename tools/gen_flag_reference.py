"""Write docs/flags.md, the reference of every flag the entry scripts and tools accept, from
their own parsers and the flag layer's tables (nothing in it is written by hand).

    .venv/bin/python tools/gen_flag_reference.py           # rewrite docs/flags.md
    .venv/bin/python tools/gen_flag_reference.py --check   # exit 1 when docs/flags.md is stale

Each script's parser is the one it parses its command line with, caught at that call (nothing
after it runs). A flag's row gives its value, default, help text and the docs sections that
describe it; flags accepted and ignored come with the reason the flag layer records
(`IGNORED_FLAGS`), refused flags and values with the error the flag layer raises for them,
verbatim.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import pkgutil
import re
import runpy
import sys
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_smp.cli import run_entry  # noqa: E402

OUTPUT = os.path.join("docs", "flags.md")
REGENERATE = ".venv/bin/python tools/gen_flag_reference.py"

# Scripts whose flags are the training flag layer's (build_parser), plus what each adds.
TRAINING_SCRIPTS = ("pretrain_gpt.py", "pretrain_llama.py", "pretrain_hybrid.py",
                    "pretrain_mamba.py", "train_dpo.py", "train_rl.py", "tools/generate.py",
                    "tools/run_text_generation_server.py")
# The command line a script needs to reach its parse (pretrain_hybrid.py checks this first).
SCRIPT_ARGV = {"pretrain_hybrid.py": ["--hybrid-layer-pattern", "M"],
               "pretrain_mamba.py": ["--hybrid-layer-pattern", "M"]}
# Tools with parsers of their own.
TOOL_SCRIPTS = ("tools/preprocess_data.py", "tools/preprocess_sft_data.py",
                "tools/train_tokenizer.py", "tools/checkpoint/convert.py",
                "tools/prepare_cache.py", "tools/estimate_memory.py", "tools/plan.py",
                "tools/build_sequences_per_dataset.py", "tools/make_tiny_llama.py",
                "tools/megatron_flag_audit.py")


class _Captured(BaseException):
    """Raised at a script's first parse (a BaseException, so no `except Exception` keeps it)."""

    def __init__(self, parser: argparse.ArgumentParser, known_only: bool):
        super().__init__()
        self.parser = parser
        self.known_only = known_only


def script_parser(script: str, argv: Sequence[str] = (),
                  module: bool = False) -> Tuple[argparse.ArgumentParser, bool]:
    """(parser, known_only) of `script` (a path relative to the repository, or a module name
    with `module=True`): the argparse parser it parses its command line with, caught at its
    first parse_args / parse_known_args call, run as `__main__` with `argv`. known_only: the
    script parsed with parse_known_args (it hands the rest of its flags on)."""

    def parse_args(self, args=None, namespace=None):
        raise _Captured(self, False)

    def parse_known_args(self, args=None, namespace=None):
        raise _Captured(self, True)

    saved = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args,
             sys.argv, os.getcwd())
    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args
    sys.argv = [script] + list(argv)
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if module:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except _Captured as captured:
        return captured.parser, captured.known_only
    finally:
        (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args,
         sys.argv) = saved[:3]
        os.chdir(saved[3])
    raise RuntimeError(f"{script} finished without parsing a command line")


def flag_layer(name: str):
    """The object `name` of the training flag layer (megatron_smp.training.arguments and its
    modules, then the other modules of megatron_smp.training and megatron_smp.config)."""
    candidates = []
    for package in ("megatron_smp.training.arguments", "megatron_smp.training",
                    "megatron_smp.config"):
        candidates.append(package)
        root = importlib.import_module(package)
        if hasattr(root, "__path__"):
            candidates += [f"{package}.{info.name}"
                           for info in pkgutil.iter_modules(root.__path__)]
    for candidate in candidates:
        try:
            found = importlib.import_module(candidate)
        except Exception:  # a module that needs an optional extra
            continue
        if name in vars(found):
            return vars(found)[name]
    raise LookupError(f"{name} is not defined in the training flag layer")


def options(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """Each option string of `parser` -> its action (-h/--help left out)."""
    return {flag: action for action in parser._actions for flag in action.option_strings
            if not isinstance(action, argparse._HelpAction)}


# ---------------------------------------------------------------------------------------------
# Where the docs describe each flag.

def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _doc_pages() -> List[Tuple[str, str]]:
    docs = os.path.join(REPO, "docs")
    return [(name, open(os.path.join(docs, name)).read()) for name in sorted(os.listdir(docs))
            if name.endswith(".md") and name not in (os.path.basename(OUTPUT), "ARCHITECTURE.md")]


def doc_mentions(pages: List[Tuple[str, str]]) -> Dict[str, List[Tuple[str, str, bool]]]:
    """flag -> [(page, heading, described)] in page order: described when the flag opens a
    table row (the row says what it does), else a mention in the text."""
    found: Dict[str, List[Tuple[str, str, bool]]] = {}
    for page, text in pages:
        heading, in_code = page[:-3], False
        for line in text.splitlines():
            if line.startswith("```"):
                in_code = not in_code
                continue
            if in_code:
                continue
            match = re.match(r"^#+ (.*)", line)
            if match:
                heading = match.group(1)
                continue
            first_cell = line.split("|")[1] if line.startswith("|") else ""
            for flag in set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", line)):
                described = flag in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", first_cell)
                entries = found.setdefault(flag, [])
                key = (page, heading)
                for index, (p, h, d) in enumerate(entries):
                    if (p, h) == key:
                        entries[index] = (p, h, d or described)
                        break
                else:
                    entries.append((page, heading, described))
    return found


def doc_descriptions(pages: List[Tuple[str, str]], limit: int = 300) -> Dict[str, str]:
    """flag -> what the first docs table row opening with it says (its second cell, cut at
    about `limit` characters), for flags without a help text or config comment."""
    found: Dict[str, str] = {}
    for _, text in pages:
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for line in text.splitlines():
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)]
            if not line.startswith("|") or len(cells) < 4 or not cells[2] or cells[2] == "---":
                continue
            for flag in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", cells[1]):
                found.setdefault(flag, cells[2])
            if "`" not in cells[1]:  # a row naming a thing in words, its flags in a later cell
                for cell in cells[3:]:
                    for flag in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", cell):
                        found.setdefault(flag, f"{cells[1]}: {cells[2]}")
    for flag, text in found.items():
        if len(text) > limit:
            found[flag] = text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return found


def _links(flag: str, mentions: Dict[str, List[Tuple[str, str, bool]]], limit: int = 3) -> str:
    entries = mentions.get(flag, [])
    ranked = [e for e in entries if e[2]] + [e for e in entries if not e[2]]
    links = []
    for page, heading, _ in ranked[:limit]:
        if heading == page[:-3]:
            links.append(f"[{page}]({page})")
            continue
        title = re.sub(r"\s*\([^()]*\)$", "", heading).strip("` ")  # the heading less its (...)
        links.append(f"[{page[:-3]}: {_cell(title)}]({page}#{_slug(heading)})")
    return "see " + ", ".join(links) if links else ""


def field_comments(cls) -> Dict[str, str]:
    """field -> the comment the source of `cls` (or of the class of its MRO declaring the
    field) gives it: a trailing comment, or the comment lines right above it."""
    import inspect

    comments: Dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        above: List[str] = []
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for line in source.splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                above.append(stripped.lstrip("#").strip())
                continue
            match = re.match(r"^\s{4}(\w+)\s*:[^=#]*(?:=[^#]*)?(?:#(.*))?$", line)
            if match and not stripped.startswith(("def ", "@", "return")):
                text = (match.group(2) or "").strip() or " ".join(above)
                if text:
                    comments[match.group(1)] = text
            above = []
    return comments


# ---------------------------------------------------------------------------------------------
# Rows.

def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    """What the flag takes, and its default."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        kind = "switch"
    else:
        if action.choices:
            kind = " \\| ".join(f"`{choice}`" for choice in action.choices)
        elif action.metavar:
            metavar = action.metavar
            kind = _cell(" ".join(metavar) if isinstance(metavar, tuple) else str(metavar))
        elif action.type is not None:
            kind = getattr(action.type, "__name__", "value").lstrip("_")
        else:
            kind = "str"
        if action.nargs in ("+", "*"):
            kind += " ..."
        elif action.nargs == "?":
            kind = f"[{kind}]"
        elif isinstance(action.nargs, int) and action.nargs > 1 and not isinstance(
                action.metavar, tuple):
            kind = " ".join([kind] * action.nargs)
    if action.required:
        return kind + ", required"
    default = action.default
    if isinstance(action, argparse._StoreTrueAction) or default in (None, argparse.SUPPRESS):
        return kind
    if isinstance(action, argparse._StoreFalseAction) or default is False:
        return kind
    if isinstance(default, list):
        default = " ".join(map(str, default))
    return f"{kind} (default `{default}`)"


def _help(action: argparse.Action) -> str:
    return "" if action.help in (None, argparse.SUPPRESS) else _cell(action.help)


def _try(argv: List[str]) -> Optional[str]:
    """The ConfigError parse_args raises for `argv` (None when it parses)."""
    from tools.megatron_flag_audit import try_parse

    outcome, message = try_parse(argv)
    return message if outcome == "error" else None


def _base_argv() -> List[str]:
    from tools.megatron_flag_audit import _BASE

    return list(_BASE)


def _refused_values(flag: str, action: argparse.Action) -> List[Tuple[str, str]]:
    """(value, error) for each choice of `flag` that the flag layer refuses when it comes
    without other flags (the error says what it needs, or that it is not built)."""
    if not action.choices or action.nargs not in (None, "?"):
        return []
    refused = []
    for choice in action.choices:
        message = _try(_base_argv() + [flag, str(choice)])
        if message and flag in message and str(choice) in message:
            refused.append((str(choice), message))
    return refused


def _refused_alone(flag: str, action: argparse.Action) -> Optional[str]:
    """The error of a switch given without other flags, when it names the switch (what it
    needs, or that it is not built)."""
    if not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return None
    message = _try(_base_argv() + [flag])
    return message if message and flag in message else None


def _describe(*parts: str) -> str:
    """Sentences of a row, in order, the empty ones left out."""
    text = ""
    for part in parts:
        part = part.strip()
        if not part:
            continue
        if text:
            text += " " if text.endswith(".") else ". "
        if part.startswith(("sets ", "on its own", "see ")):  # this tool's own phrases
            part = part[0].upper() + part[1:]
        text += part
    return text


def _section_classes() -> Dict[str, type]:
    """config section name -> its dataclass, from the fields of the Configs dataclass."""
    import megatron_smp.config as config

    configs = flag_layer("Configs")
    module = sys.modules[configs.__module__]
    classes = {}
    for field in dataclasses.fields(configs):
        kind = field.type
        if isinstance(kind, str):  # postponed annotations: the name, in its module or config
            kind = getattr(module, kind, None) or getattr(config, kind, None)
        if kind is not None and dataclasses.is_dataclass(kind):
            classes[field.name] = kind
    return classes


def _section_titles() -> Dict[str, str]:
    return {name: cls.__name__ for name, cls in _section_classes().items()}


def _training_rows(parser: argparse.ArgumentParser, mentions) -> Dict[str, List[str]]:
    """Rows of the common training flags, by config section ("" for flags that are not one
    config field: post-processed or shorthands)."""
    titles = _section_titles()
    comments = {name: field_comments(cls) for name, cls in _section_classes().items()}
    described = doc_descriptions(_doc_pages())
    ignored = flag_layer("IGNORED_FLAGS")
    rows: Dict[str, List[str]] = {}
    seen = set()
    for flag, action in options(parser).items():
        if flag in ignored or action in seen:
            continue
        seen.add(action)
        section, _, field = action.dest.partition("__")
        if not field:
            section, field = "", action.dest
        flags = " ".join(f"`{f}`" for f in action.option_strings)
        what = (_help(action) or _cell(comments.get(section, {}).get(field, ""))
                or described.get(flag, ""))
        sets = f"sets `{titles.get(section, section)}.{field}`" if section else ""
        errors = []
        refused = _refused_alone(flag, action)
        if refused:
            errors.append(f"on its own: error \"{_cell(refused)}\"")
        errors += [f"`{value}` on its own: error \"{_cell(message)}\""
                   for value, message in _refused_values(flag, action)]
        what = _describe(f"{what}; {sets}" if what and sets else what or sets, *errors,
                         _links(flag, mentions))
        rows.setdefault(section, []).append(f"| {flags} | {_value(action)} | {what} |")
    return rows


def _refused_rows() -> List[str]:
    """Flags the flag layer refuses whatever their value, with its error."""
    not_supported = flag_layer("NOT_SUPPORTED_YET_FLAGS")
    values = flag_layer("_NOT_SUPPORTED_YET_VALUES")
    prefixes = flag_layer("_LOW_PRECISION_FLAG_PREFIXES")
    low_precision = flag_layer("_LOW_PRECISION_FLAGS")
    rows = []
    # Deterministic messages: the FP8 error says whether Transformer Engine imports.
    saved = sys.modules.get("transformer_engine", None)
    sys.modules["transformer_engine"] = None  # type: ignore[assignment]
    try:
        # Flags refused whatever their value; flags with the same error but for their name
        # share a row.
        from megatron_smp.training.arguments import megatron_lm

        whole = (set(not_supported) | set(flag_layer("NEEDS_NVIDIA_FLAGS"))
                 | set(megatron_lm.MEGATRON_ERRORS))
        grouped: Dict[str, List[Tuple[str, str]]] = {}
        for flag in sorted(whole):
            message = _try(_base_argv() + [flag])
            grouped.setdefault((message or "").replace(flag, "\0"), []).append((flag, message))
        for members in grouped.values():
            rows.append(("`, `".join(flag for flag, _ in members), members[0][1]))
        for flag, value in sorted(values):
            rows.append((f"{flag} {value}", _try(_base_argv() + [flag, value])))
        for prefix in prefixes:
            rows.append((f"{prefix}*", _try(_base_argv() + [f"{prefix}format"])))
        for flag in sorted(low_precision):
            rows.append((flag, _try(_base_argv() + [flag])))
        rows.append(("--moe-* (any other)", _try(_base_argv() + ["--moe-other-option"])))
    finally:
        if saved is None:
            del sys.modules["transformer_engine"]
        else:
            sys.modules["transformer_engine"] = saved
    for flag, message in rows:
        if not message:
            raise RuntimeError(f"{flag} is listed as refused but parses")
    return [f"| `{flag}` | {_cell(message)} |" for flag, message in rows]


def _plain_rows(actions: List[argparse.Action], mentions=None) -> List[str]:
    """Rows of flags outside the flag layer; `mentions`: link the docs that describe them."""
    rows = []
    for action in actions:
        links = _links(action.option_strings[0], mentions) if mentions else ""
        what = _describe(_help(action), links)
        flags = " ".join(f"`{f}`" for f in action.option_strings)
        rows.append(f"| {flags} | {_value(action)} | {what} |")
    return rows


_TABLE = ["| flag | value | what it does here |", "| --- | --- | --- |"]


def render() -> str:
    from megatron_smp.training.arguments import build_parser

    mentions = doc_mentions(_doc_pages())
    common = build_parser()
    common_flags = set(options(common))
    ignored = flag_layer("IGNORED_FLAGS")
    out = [
        "# Flag reference",
        "",
        f"<!-- Generated from the parsers by tools/gen_flag_reference.py: do not edit. "
        f"Regenerate: {REGENERATE} -->",
        "",
        f"Generated from the parsers (regenerate with `{REGENERATE}`; a test fails while "
        "this file differs from what it writes). Flag names and meanings are Megatron-LM's "
        "unless a row says otherwise. Three kinds:",
        "",
        "* [flags that do what they say](#training-flags), by the config section they fill;",
        "* [flags accepted and ignored](#accepted-and-ignored): they only pick a Megatron "
        "implementation detail with no effect on results or memory here;",
        "* [flags refused](#refused): a capability that is not built; the error names the "
        "flag and what would work.",
        "",
        "A flag or value refused only in some combinations says so when given; its row "
        "links to the docs that describe it.",
        "",
        "## Training flags",
        "",
        "Taken by " + ", ".join(f"`{s}`" for s in TRAINING_SCRIPTS) + ". The entry scripts "
        "differ in defaults only (`pretrain_llama.py`: RMSNorm, SwiGLU, RoPE, untied output, "
        "no biases, no dropout); the last four add the flags listed after these.",
        "",
    ]
    for script in TRAINING_SCRIPTS[1:4]:
        parser, _ = script_parser(script, SCRIPT_ARGV.get(script, []))
        if set(options(parser)) != common_flags:
            raise RuntimeError(f"{script} takes other flags than pretrain_gpt.py: list them")
    rows = _training_rows(common, mentions)
    titles = _section_titles()
    for section in list(titles) + [""]:
        if section not in rows:
            continue
        name = f"{section.capitalize()} (`{titles[section]}`)" if section else (
            "Shorthands and flags read together (post-processed into several fields)")
        out += [f"### {name}", ""] + _TABLE + rows[section] + [""]

    # What the other entry scripts add, grouped by the scripts that take each flag.
    added: Dict[str, Tuple[argparse.Action, List[str]]] = {}
    for script in TRAINING_SCRIPTS[4:]:
        parser, _ = script_parser(script, SCRIPT_ARGV.get(script, []))
        for flag, action in options(parser).items():
            if flag not in common_flags and flag == action.option_strings[0]:
                added.setdefault(flag, (action, []))[1].append(script)
    groups: Dict[Tuple[str, ...], List[argparse.Action]] = {}
    for flag, (action, scripts) in added.items():
        groups.setdefault(tuple(scripts), []).append(action)
    for scripts, actions in groups.items():
        out += ["### Added by " + " and ".join(f"`{s}`" for s in scripts), ""]
        out += _TABLE + _plain_rows(actions, mentions) + [""]

    out += ["## Accepted and ignored", "",
            "Accepted so that scripts written for Megatron-LM run, and ignored: each only "
            "picks an implementation detail of Megatron's with no effect on results or "
            "memory here.", "",
            "| flag | why it changes nothing here |", "| --- | --- |"]
    out += [f"| `{flag}` | {_cell(reason)} |" for flag, reason in ignored.items()]
    out += [f"| `{flag}` without `{other}` | {_cell(reason)} |"
            for flag, (other, reason) in flag_layer("IGNORED_WITHOUT").items()]
    out += ["", "## Refused", "",
            "Given on any entry script, each of these stops the run before anything starts, "
            "with this error (a row of several flags shows the first one's; each names "
            "itself):", "",
            "| flag | the error |", "| --- | --- |"]
    out += _refused_rows() + [""]

    out += ["## Tools", ""]
    for script in TOOL_SCRIPTS:
        parser, known_only = script_parser(script)
        actions = [a for a in parser._actions if a.option_strings
                   and not isinstance(a, argparse._HelpAction)]
        positionals = [a for a in parser._actions if not a.option_strings]
        out += [f"### `{script}`", ""]
        description = (parser.description or "").strip()
        if description:
            out += [_cell(description), ""]
        if known_only:
            out += ["It takes the training flags above besides its own.", ""]
        if positionals:
            out += ["Arguments: " + ", ".join(
                f"`{a.metavar or a.dest}`" + (f" ({_cell(a.help)})" if _help(a) else "")
                for a in positionals), ""]
        out += _TABLE + _plain_rows(actions) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 when {OUTPUT} differs from what would be written")
    args = parser.parse_args(argv)
    text = render()
    path = os.path.join(REPO, OUTPUT)
    current = open(path).read() if os.path.exists(path) else ""
    if args.check:
        if current != text:
            print(f"{OUTPUT} is stale: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    with open(path, "w") as handle:
        handle.write(text)
    print(f"wrote {OUTPUT} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(run_entry(main))
