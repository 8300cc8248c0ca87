"""The package root is lazy: a config or a data tool imports only what it uses; imports point
down (no circles, DESIGN.md's directions between packages)."""
import functools
import json
import os
import subprocess
import sys


def _our_modules(statement: str):
    code = (f"import json, sys; {statement}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('megatron_smp'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_config_is_cheap():
    modules = _our_modules("import megatron_smp.config")
    assert len(modules) <= 15, modules
    assert all(m.startswith("megatron_smp.config") for m in modules[1:]), modules


def test_import_config_does_not_import_torch():
    code = "import sys, megatron_smp.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_indexed_dataset_imports_no_model_code():
    modules = _our_modules("import megatron_smp.data.indexed_dataset")
    model_code = [m for m in modules if not m.startswith("megatron_smp.data")
                  and m not in ("megatron_smp", "megatron_smp.config")]
    assert model_code == [], model_code


def test_root_names_still_resolve():
    import megatron_smp as smp
    from megatron_smp.smp import MoEConfig, init

    assert smp.init is init and smp.MoEConfig is MoEConfig
    assert smp.smp.__name__ == "megatron_smp.smp"


@functools.lru_cache(maxsize=None)
def _imports_by_module(package_dir: str):
    """{module: modules of ours it imports (at the top or inside functions)}."""
    import ast

    root = os.path.dirname(package_dir)
    modules = {}
    for folder, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    edges = {module: set() for module in modules}
    for module, path in modules.items():
        with open(path) as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    target = candidate if candidate in modules else node.module
                    if target in modules and target != module:
                        edges[module].add(target)
            elif isinstance(node, ast.Import):
                edges[module].update(a.name for a in node.names
                                     if a.name in modules and a.name != module)
    return edges


def test_no_two_file_import_circles():
    """Imports point down: no two modules import each other (a package and its own
    submodules excepted: the package re-exports them)."""
    import megatron_smp

    edges = _imports_by_module(os.path.dirname(megatron_smp.__file__))
    circles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a]
                      if a in edges.get(b, ()) and not b.startswith(a + ".")
                      and not a.startswith(b + ".")})
    assert circles == [], circles


def test_no_import_circles():
    """No longer circles either (a -> b -> c -> a), by the same rule."""
    import megatron_smp

    edges = _imports_by_module(os.path.dirname(megatron_smp.__file__))
    graph = {a: {b for b in targets if b in edges and not b.startswith(a + ".")
                 and not a.startswith(b + ".")} for a, targets in edges.items()}
    circles, done = [], set()

    def visit(module, path):
        for target in sorted(graph[module]):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert circles == [], circles



def _package(module: str) -> str:
    """megatron_smp.<package>.x -> <package> (a top-level module is its own package)."""
    return module.split(".")[1] if "." in module else ""


# DESIGN.md's directions: what each package never imports (besides nothing importing
# post_training, and config importing nothing of ours).
NEVER_IMPORTS = {
    "inference": {"training", "post_training"},
    "data": {"tensor_parallel", "transformer", "context_parallel", "models", "training"},
    "tensor_parallel": {"transformer", "models"},
    "models": {"training", "optimizer"},
}


def test_imports_point_down_between_packages():
    import megatron_smp

    edges = _imports_by_module(os.path.dirname(megatron_smp.__file__))
    wrong = []
    for module, targets in sorted(edges.items()):
        source = _package(module)
        for target in sorted(targets):
            package = _package(target)
            if package == source:
                continue
            if (package in NEVER_IMPORTS.get(source, ()) or package == "post_training"
                    or source == "config"):
                wrong.append(f"{module} -> {target}")
    assert wrong == [], wrong


# The one package pair that imports both ways: the Mamba / Gated DeltaNet layers mix their
# sequence over context parallelism with the CP package's layout and all-to-all (a lazy
# import), while the CP attention cores build on the transformer's attention.
TWO_WAY_EXCEPTIONS = {("megatron_smp.transformer.ssm.layers", "context_parallel")}


def test_no_two_packages_import_each_other():
    """At the level of packages too, imports point one way (a module-level edge from a
    package to another that imports it back is a circle between the two)."""
    import megatron_smp

    edges = _imports_by_module(os.path.dirname(megatron_smp.__file__))
    by_package = {}
    for module, targets in edges.items():
        for target in targets:
            if _package(module) != _package(target) and \
                    (module, _package(target)) not in TWO_WAY_EXCEPTIONS:
                by_package.setdefault(_package(module), set()).add(_package(target))
    both_ways = sorted((a, b) for a, targets in by_package.items() for b in targets
                       if a in by_package.get(b, ()) and a < b)
    assert both_ways == [], both_ways
