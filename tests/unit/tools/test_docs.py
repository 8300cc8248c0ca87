"""The docs hold: docs/flags.md is what tools/gen_flag_reference.py writes from the parsers,
every link and repository path in README.md and docs/ exists, every shell command in their
code blocks parses through the parser of the script it runs, and the steps a page says a
script runs (scripts run by the tests: tests/unit/training/test_launch_scripts.py,
tests/unit/post_training/) are the steps that script runs."""
import argparse
import contextlib
import io
import os
import re
import shlex
import stat
import subprocess

import pytest

from tools.gen_flag_reference import (
    OUTPUT,
    REGENERATE,
    REPO,
    TRAINING_SCRIPTS,
    render,
    script_parser,
)

PAGES = ["README.md"] + sorted(os.path.join("docs", name)
                               for name in os.listdir(os.path.join(REPO, "docs"))
                               if name.endswith(".md"))
# Programs whose command lines the docs show but that are not ours to parse.
EXTERNAL = {"lm_eval", "curl", "pytest", "export", "cd", "pip", "sbatch-only"}
# Paths the commands write (outputs), or name as examples of the user's own files; Megatron-LM's
# example scripts (paths in a Megatron-LM checkout).
USER_PATH = re.compile(r"^(data/generated/|ckpt|runs/|hf/|v1/|my-|llama-|megatron|tok/|"
                       r"path/to/|prompts|completions|sft_ckpt|rl_ckpt|hf_dir|add\.jsonl|smp\.json|"
                       r"examples/(gpt3|llama|mixtral|mamba)/)")


def _read(page):
    with open(os.path.join(REPO, page)) as handle:
        return handle.read()


def test_flag_reference_is_current():
    expected = render()
    with open(os.path.join(REPO, OUTPUT)) as handle:
        assert handle.read() == expected, (
            f"{OUTPUT} is not what the parsers give: regenerate it with `{REGENERATE}`")


def _slug(heading):
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text):
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {_slug(heading) for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_links_resolve():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            destination = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path \
                else page
            if not os.path.exists(os.path.join(REPO, destination)):
                missing.append(f"{page}: {target}")
            elif anchor and destination.endswith(".md") and anchor not in _anchors(
                    _read(destination)):
                missing.append(f"{page}: {target} (no such heading)")
    assert missing == []


def _repository_paths(text):
    """Tokens that name a file of the repository: inline code and code-block words starting
    with one of its top-level folders or entry scripts."""
    tops = ("scripts/", "tools/", "tests/", "megatron_smp/", "examples/", "docs/", "data/",
            ".ci/")
    found = set()
    for token in re.findall(r"(?<![\w/-])[\w./-]+", text):
        token = token.rstrip(".")
        if token.startswith(tops) or (re.fullmatch(r"(pretrain|train)_\w+\.py|setup\.py", token)
                                      and not os.path.exists(os.path.join(REPO, "tools", token))):
            if re.search(r"\.(py|sh|sbatch|md|yaml|jsonl|c|json|gz|txt)$", token) \
                    or token.endswith("/"):
                found.add(token)
    return found


def test_repository_paths_exist():
    missing = sorted(f"{page}: {path}" for page in PAGES for path in _repository_paths(_read(page))
                     if not USER_PATH.match(path) and not os.path.exists(os.path.join(REPO, path)))
    assert missing == []


# ---------------------------------------------------------------------------------------------
# Shell commands.

def _bash_blocks(text):
    """(line number, body) of each ```bash block."""
    return [(text[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"```bash\n(.*?)```", text, flags=re.S)]


def _commands(body):
    """The command lines of a block: continuations joined, comments and env prefixes gone,
    `[...]` optional parts kept without their brackets, `...` dropped."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        tokens = [t for t in tokens if t not in ("...", "[...]")]
        tokens = [t.strip("[]") if t.startswith("[") or t.endswith("]") else t for t in tokens]
        while tokens and re.fullmatch(r"\w+=\S*", tokens[0]):
            tokens = tokens[1:]
        if tokens:
            commands.append(tokens)
    return commands


def _shell_entry(script, depth=0):
    """The entry script that a shell script's extra arguments ("$@") reach, or None."""
    with open(os.path.join(REPO, script)) as handle:
        text = handle.read().replace("\\\n", " ")
    for line in text.splitlines():
        if '"$@"' not in line or line.lstrip().startswith("#"):
            continue
        entries = [e for e in re.findall(r"[\w/]+\.py", line) if e in TRAINING_SCRIPTS]
        if entries:
            return entries[-1]
        inner = re.findall(r"scripts/[\w/]+\.sh", line)
        if inner and depth < 3:
            return _shell_entry(inner[-1], depth + 1)
    return None  # its arguments go to another program (scripts/run_tests.sh: pytest)


_PARSERS = {}


def _parser(script, module=False):
    if script not in _PARSERS:
        hint = ["--hybrid-layer-pattern", "M"] if script in ("pretrain_hybrid.py",
                                                            "pretrain_mamba.py") else []
        parser, known_only = script_parser(script, hint, module=module)
        for action in parser._actions:
            action.required = False
        _PARSERS[script] = parser, known_only
    return _PARSERS[script]


def _parse(script, argv, module=False):
    """None when `argv` parses through `script`'s parser, else argparse's message."""
    from megatron_smp.training.arguments import build_parser

    parser, known_only = _parser(script, module)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            if known_only:
                _, rest = argparse.ArgumentParser.parse_known_args(parser, argv)
                training = build_parser()
                for action in training._actions:
                    action.required = False
                training.parse_args(rest)
            else:
                argparse.ArgumentParser.parse_args(parser, argv)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    return None


def _split_command(tokens):
    """(script or module, is_module, arguments) of a command line, or None for programs that
    are not this repository's."""
    program = os.path.basename(tokens[0])
    if program in ("python", "python3"):
        if tokens[1] == "-m":
            return tokens[2], True, tokens[3:]
        return tokens[1], False, tokens[2:]
    if program == "torchrun":
        index = next(i for i, t in enumerate(tokens) if t.endswith(".py"))
        return tokens[index], False, tokens[index + 1:]
    if program in ("bash", "sbatch"):
        index = next(i for i, t in enumerate(tokens) if t.endswith((".sh", ".sbatch")))
        return tokens[index], False, tokens[index + 1:]
    if tokens[0].endswith(".sh"):
        return tokens[0], False, tokens[1:]
    assert program in EXTERNAL, f"a command of an unknown program: {' '.join(tokens)}"
    return None


def _doc_commands():
    for page in PAGES:
        for line, body in _bash_blocks(_read(page)):
            for tokens in _commands(body):
                yield f"{page}:{line}", tokens


def test_doc_commands_parse():
    """Each command's flags parse through the parser of the script it runs (a shell script's
    extra arguments: the entry script they reach), and the script exists."""
    failures = []
    checked = 0
    for where, tokens in _doc_commands():
        split = _split_command(tokens)
        if split is None:
            continue
        script, module, argv = split
        if not module and not os.path.exists(os.path.join(REPO, script)):
            failures.append(f"{where}: {script} does not exist")
            continue
        if script.endswith((".sh", ".sbatch")):
            script, module = _shell_entry(script), False
            if script is None:
                continue
        message = _parse(script, argv, module)
        checked += 1
        if message:
            failures.append(f"{where}: {script} {' '.join(argv)}: {message}")
    assert failures == []
    assert checked >= 20


# ---------------------------------------------------------------------------------------------
# "The steps it runs, each usable alone": the steps the script runs.

def _documented_steps():
    """(page, script, its documented steps) for each block that a page introduces with "The
    steps it runs" (the script is the one the block before runs) or "A step of
    `scripts/X.sh`"."""
    for page in PAGES:
        text = _read(page)
        blocks = list(re.finditer(r"```bash\n(.*?)```", text, flags=re.S))
        for before, block in zip([None] + blocks, blocks):
            between = text[before.end() if before else 0:block.start()]
            named = re.search(r"A step of `(scripts/[\w/]+\.sh)`", between)
            if named:
                yield page, named.group(1), _commands(block.group(1))
            elif before and "The steps it runs" in between:
                script = next(t for t in _commands(before.group(1))[0] if t.endswith(".sh"))
                yield page, script, _commands(block.group(1))


def _recorded_steps(script, tmp_path):
    """Each step's command line as `script` runs it (a stub interpreter records them)."""
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" ---- >> "$STUB_OUT"\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "argv.txt"
    out.write_text("")
    subprocess.run(["bash", os.path.join(REPO, script)], check=True, timeout=60,
                   env=dict(os.environ, PYTHON=str(stub), GPUS_PER_NODE="0", NPROC_PER_NODE="1",
                            STUB_OUT=str(out), HF_MODEL="hf/llama", OUT=str(tmp_path / "run")))
    return [step.strip("\n").splitlines() for step in out.read_text().split("----")[:-1]]


def _script_and_flags(tokens):
    script = next(t for t in tokens if t.endswith(".py"))
    return script, {t for t in tokens[tokens.index(script) + 1:] if t.startswith("--")}


@pytest.mark.parametrize("page,script,steps", list(_documented_steps()),
                         ids=lambda value: value if isinstance(value, str) else "")
def test_documented_steps_are_the_scripts(page, script, steps, tmp_path):
    """Each documented step is a step of the script: the same entry script, and the flags the
    page shows are among the ones the script passes."""
    recorded = [_script_and_flags(step) for step in _recorded_steps(script, tmp_path)
                if any(token.endswith(".py") for token in step)]
    assert steps
    for step in steps:
        entry, flags = _script_and_flags(step)
        matches = [given for name, given in recorded if name == entry and flags <= given]
        assert matches, (f"{page}: {' '.join(step)} is not a step of {script}: its steps are "
                         f"{[(name, sorted(given)) for name, given in recorded]}")


def _shell_assignments(text):
    """NAME=value lines of a shell script, values expanded in order (plain ones only)."""
    values = {}
    for name, value in re.findall(r"^([A-Z_]+)=(\S+)$", text, flags=re.M):
        values[name] = _expand(value.strip('"'), values)
    return values


def _expand(text, values):
    text = re.sub(r"\$\{(\w+)%\.model\}", lambda m: values[m.group(1)][:-len(".model")], text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), text)


def _quickstart_commands():
    """The command lines scripts/quickstart.sh runs (its python and torchrun ones), with its
    variables expanded."""
    text = _read("scripts/quickstart.sh")
    values = _shell_assignments(text)
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        if line.strip().startswith((".venv/bin/python tools/", ".venv/bin/torchrun")):
            commands.append([t for t in shlex.split(_expand(line, values)) if t != "$@"])
    return commands


def test_quickstart_commands_shown_are_the_scripts():
    """A block the docs introduce as what scripts/quickstart.sh runs holds its commands."""
    script = _quickstart_commands()
    shown = 0
    for page in PAGES:
        text = _read(page)
        for intro in re.finditer(r"`scripts/quickstart\.sh` runs", text):
            block = re.search(r"```bash\n(.*?)```", text[intro.end():], flags=re.S).group(1)
            for command in _commands(block):
                assert command in script, f"{page}: {' '.join(command)} is not quickstart's"
                shown += 1
    assert shown >= 3


def test_every_flag_says_what_it_does():
    """Each row of docs/flags.md's training flags says what the flag does (a help text, the
    config field it sets, or the docs' description), not only where to read about it."""
    with open(os.path.join(REPO, OUTPUT)) as handle:
        text = handle.read()
    training = text[text.index("## Training flags"):text.index("## Accepted and ignored")]
    bare = [row.split(" | ")[0] for row in training.splitlines() if row.startswith("| `--")
            and re.match(r"^(See |On its own|$)", row.split(" | ")[2].strip(" |"))]
    assert bare == [], f"give these flags a help text (then run {REGENERATE})"


def test_readme_tour_lists_the_packages():
    """The README's tour names every package and module of megatron_smp/ (and nothing else)."""
    readme = _read("README.md")
    tour = re.search(r"## A short tour\n\n```\n(.*?)```", readme, flags=re.S).group(1)
    listed = set(re.findall(r"^  (\w+(?:/|\.py))\s", tour, flags=re.M))
    present = {name + "/" if os.path.isdir(os.path.join(REPO, "megatron_smp", name)) else name
               for name in os.listdir(os.path.join(REPO, "megatron_smp"))
               if not name.startswith(("_", ".")) and (name.endswith(".py") or os.path.isfile(
                   os.path.join(REPO, "megatron_smp", name, "__init__.py")))}
    assert listed == present
