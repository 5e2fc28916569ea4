"""The tree's layers, checked: dependencies point one way (core <- adapters <- services <- operator tools; the
simulators depend on the core only), over every import in every module (top-level, function-level and
``TYPE_CHECKING`` alike), and a fresh interpreter that imports the whole core loads no server, client or
simulator library.

Each package's ``__init__`` docstring says what it may import; this is the rule those docstrings state.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inferlb", "xds_server", "ext_proc", "ext_authz", "epp", "simulation")

#: Layer of each module prefix; the longest matching prefix wins.
LAYER_OF = {
    "inferlb": "core",  # inferlb/__init__.py: the version only
    "inferlb.errors": "core",
    "inferlb.traces": "core",
    "inferlb.config": "core",
    "inferlb.request": "core",
    "inferlb.policy": "core",
    "inferlb.adapters": "adapters",
    "xds_server": "services",
    "ext_proc": "services",
    "ext_authz": "services",
    "epp": "services",
    "inferlb.ops": "ops",
    "inferlb.__main__": "ops",
    "simulation": "simulation",
}

#: The core's packages: each may import only these.
CORE = ("inferlb.errors", "inferlb.traces", "inferlb.config", "inferlb.request", "inferlb.policy")

#: Project modules each layer may import (prefixes).
MAY_IMPORT = {
    "core": CORE,
    "adapters": (*CORE, "inferlb.adapters"),
    # each service its own package only: see FORBIDDEN_WITHIN
    "services": (*CORE, "inferlb.adapters", "xds_server", "ext_proc", "ext_authz", "epp"),
    # operator tools run the services as processes; they import only the pure Envoy bootstrap of one
    "ops": (*CORE, "inferlb.adapters", "inferlb.ops", "xds_server.bootstrap"),
    "simulation": (*CORE, "simulation"),
}

#: Finer rules inside a layer: (importer prefix, prefixes it must not import).
FORBIDDEN_WITHIN = (
    # the request side knows nothing of the config model or the policies
    ("inferlb.request", ("inferlb.config", "inferlb.policy", "inferlb.traces")),
    ("inferlb.config", ("inferlb.policy", "inferlb.traces")),
    # the services never import each other, except that ext_authz serves ext_proc's transport-free modules
    # (handlers, state, process, poller, stores, metrics) over HTTP: never its gRPC servicer or process
    ("xds_server", ("ext_proc", "ext_authz", "epp")),
    ("ext_proc", ("xds_server", "ext_authz", "epp")),
    ("ext_authz", ("xds_server", "ext_proc.servicer", "ext_proc.__main__", "epp")),
    # the endpoint picker stands alone beside a gateway inferlb did not configure
    ("epp", ("xds_server", "ext_proc", "ext_authz")),
    # the fleet simulation takes its serving engines by injection
    ("simulation.fleetsim", ("simulation.gpusim",)),
)

#: Third-party top-level packages a layer must not import (servers, clients, NVML, the Envoy protos).
FORBIDDEN_LIBRARIES = {
    "core": {
        *("grpc", "aiohttp", "redis", "pynvml", "envoy", "xds", "udpa", "google", "uvloop", "rich", "psutil"),
    },
    "adapters": {"grpc", "aiohttp", "envoy", "xds", "udpa", "google", "uvloop", "rich"},
    "services": {"pynvml", "rich", "matplotlib"},
    # ext_authz is HTTP only: no gRPC, no Envoy protos (checked apart, see EXT_AUTHZ_FORBIDDEN_LIBRARIES)
    "ops": {"grpc", "envoy", "xds", "udpa", "google", "uvloop", "matplotlib"},
    "simulation": {"grpc", "redis", "pynvml", "envoy", "xds", "udpa", "google", "uvloop", "rich"},
}


#: Libraries ext_authz must not import on top of the services' list: its checks speak HTTP/1.1 only.
EXT_AUTHZ_FORBIDDEN_LIBRARIES = {"grpc", "envoy", "xds", "udpa", "google"}
#: The one ext_authz module that may touch grpc: the process, which starts the settler's access-log
#: receiver (:mod:`ext_proc.access_log`) beside the HTTP checks.
EXT_AUTHZ_GRPC_MODULES = ("ext_authz.__main__",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def imports(path: Path, text: str) -> Iterator[tuple[int, str]]:
    """Every module the source ``text`` of ``path`` imports (absolute names; relative imports resolved),
    with its line."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            yield node.lineno, mod
            # `from pkg import submodule` imports pkg.submodule
            for alias in node.names:
                yield node.lineno, f"{mod}.{alias.name}"


def project_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def module_violations(path: Path, text: str, known: set[str]) -> list[str]:
    """The imports of one module (source ``text`` at ``path``) that break the layer rules."""
    out: list[str] = []
    here = module_name(path)
    lay = layer(here)
    for line, target in imports(path, text):
        where = f"{path.relative_to(ROOT)}:{line}: {here} ({lay}) imports {target}"
        top = target.split(".")[0]
        if top in PACKAGES:
            if target not in known and target.rpartition(".")[0] in known:
                continue  # `from module import name`: the name, not a module
            if not under(target, MAY_IMPORT[lay]):
                out.append(where)
            for importer, banned in FORBIDDEN_WITHIN:
                if under(here, (importer,)) and under(target, banned):
                    out.append(where)
        elif top in FORBIDDEN_LIBRARIES[lay] or (
            under(here, ("ext_authz",))
            and top in EXT_AUTHZ_FORBIDDEN_LIBRARIES
            and not (top == "grpc" and here in EXT_AUTHZ_GRPC_MODULES)
        ):
            out.append(where)
    return out


def known_modules() -> set[str]:
    return {module_name(p) for p in project_modules()}


def test_every_module_of_the_tree_has_a_layer() -> None:
    mods = [module_name(p) for p in project_modules()]
    assert len(mods) > 50
    assert all(layer(m) in MAY_IMPORT for m in mods)


def test_dependencies_point_one_way() -> None:
    known = known_modules()
    found = [v for p in project_modules() for v in module_violations(p, p.read_text(encoding="utf-8"), known)]
    assert found == []


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("inferlb/policy/weights.py", "import grpc"),
        ("inferlb/policy/weights.py", "from xds_server.cache import SnapshotCache"),
        ("inferlb/request/tokens.py", "from inferlb.config.schema import Config"),
        ("inferlb/adapters/quota_redis.py", "from ext_proc import handlers"),
        ("ext_proc/handlers.py", "from simulation.gpusim import engine"),
        ("ext_proc/servicer.py", "from xds_server import cache"),
        ("ext_proc/handlers.py", "from ext_authz import check"),
        ("ext_authz/check.py", "from ext_proc.servicer import ExternalProcessor"),
        ("ext_authz/server.py", "import grpc"),
        ("epp/server.py", "from ext_proc.servicer import RESET_WAIT_S"),
        ("ext_proc/servicer.py", "from epp.exchange import Exchange"),
        ("epp/exchange.py", "from simulation.gpusim import server"),
        ("xds_server/cache.py", "from inferlb.ops.stack import Stack"),
        ("inferlb/ops/cli.py", "from simulation.gpusim.server import SimulatedEndpoint"),
        ("simulation/gpusim/server.py", "from inferlb.adapters.quota_redis import RedisQuotaStore"),
        ("simulation/gpusim/server.py", "import grpc"),
    ],
)
def test_the_rule_catches_a_wrong_way_import(path: str, line: str) -> None:
    """The rule is not vacuous: one wrong-way import added to a real module is reported at that line."""
    source = ROOT / path
    text = f"{line}\n{source.read_text(encoding='utf-8')}"
    found = module_violations(source, text, known_modules())
    assert any(v.startswith(f"{path}:1:") for v in found), found


def test_the_core_loads_no_server_client_or_simulator() -> None:
    core = sorted(m for m in map(module_name, project_modules()) if layer(m) == "core")
    banned = sorted(
        {"grpc", "aiohttp", "redis", "pynvml", "uvloop", "envoy", "xds_server", "ext_proc", "simulation"}
        | {"inferlb.ops", "inferlb.adapters"}
    )
    code = (
        "import importlib, sys\n"
        f"for m in {core!r}: importlib.import_module(m)\n"
        f"banned = {banned!r}\n"
        "print(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') for b in banned)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_every_package_docstring_names_its_modules_and_what_it_may_import() -> None:
    """The README sends readers to the package docstrings for the layout: each names every module and
    subpackage it holds, and says what the package may import."""
    missing: list[str] = []
    for init in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        here = module_name(init)
        children = sorted(
            {p.stem for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__")}
            | {p.parent.name for p in init.parent.glob("*/__init__.py")}
        )
        missing += [f"{here}: {c}" for c in children if f"{here}.{c}" not in doc and f"``{c}``" not in doc]
        if here != "inferlb" and not any(w in doc for w in ("May import", "may import", "importing only")):
            missing.append(f"{here}: what it may import")
    assert missing == []


#: Module names that several packages share because they hold the same kind of thing in each: the package's
#: entry and process, its server, its own Prometheus registry, vLLM's KV events over ZMQ (gpusim
#: publishes them, the gateway's adapter subscribes to them), and ``picking``: a request-path service's
#: glue between its requests and the endpoint picker (:mod:`inferlb.policy.picker`), in ext_proc/ext_authz
#: and in the EPP alike.
SHARED_MODULE_NAMES = {"__init__", "__main__", "server", "metrics", "kv_events", "picking"}


def test_one_meaning_per_module_name() -> None:
    """No two modules of the tree share a name unless it means the same thing in each package."""
    by_name: dict[str, list[str]] = {}
    for path in project_modules():
        by_name.setdefault(path.stem, []).append(module_name(path))
    shared = {name: mods for name, mods in by_name.items() if len(mods) > 1}
    assert set(shared) <= SHARED_MODULE_NAMES, shared
