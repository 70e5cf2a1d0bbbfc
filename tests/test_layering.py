"""Layers import downward only, modules inside a package import in one order, and there is no cycle.

Order between packages (docs/design.md §3): tree, dtypes and untrusted, spec, plan, comm, data and shard,
execute, then optim / checkpoint / interop, then the command line. Inside each
package, :data:`ORDER` lists its modules from the bottom up: a module imports only
modules listed before it. Only the runtime layers touch torch.distributed. A
failure names the module and the import that breaks the order.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import funcshard

PACKAGE = Path(funcshard.__file__).parent
SRC = PACKAGE / "_src"
LAYERS = {
    "tree": 0,
    "dtypes": 0,
    "untrusted": 0,
    "untrusted_pickle": 0,
    "untrusted_tensor": 1,
    "spec": 1,
    "tree_json": 1,
    "plan": 2,
    "comm": 3,
    "data": 4,
    "shard": 4,
    "execute": 5,
    "optim": 6,
    "checkpoint": 6,
    "interop": 7,
    "verify": 7,
    "calibrate": 7,
    "cli": 8,
}
ORDER = {
    "spec": ["mesh", "partition_spec", "named_sharding", "flat_sharding"],
    "plan": [
        "rules",
        "strategy",
        "precision",
        "quantize",
        "sizes",
        "units",
        "leaf",
        "plan",
        "model_config",
        "presets",
        "activations",
        "hardware",
        "efficiency",
        "step_time",
        "cost_model",
        "estimates",
        "explain",
        "resolve",
        "step_counts",
        "unit_cost",
        "cost",
        "search",
        "advice",
        "auto",
        "planner",
    ],
    "comm": [
        "runtime",
        "channel",
        "settle",
        "lifecycle",
        "metrics",
        "groups",
        "transport",
        # the shared-memory transport, a plug-in ([Note: transports] in comm/transport.py)
        "shm.regions",
        "shm",
        "collectives",
        "quantized",
    ],
    "data": ["sampler", "seed"],
    "shard": [
        "aliasing",
        "digest",
        "counter_rng",
        "fill",
        "initializers",
        "fans",
        "orthogonal",
        "layout",
        "flat",
        "sharded",
        "shard",
        "materialize",
    ],
    "execute": [
        "reference",
        "unit_state",
        "streams",
        "gradients",
        "param_group",
        "call_record",
        "run",
        "replay",
        "compiled",
        "call",
        "value_and_grad",
        "forward",
    ],
    "optim": [
        "base",
        "schedules",
        "select",
        "sgd",
        "adamw",
        "lion",
        "clip",
        "nonfinite",
        "adafactor_state",
        "adafactor",
        "chain",
        "ema",
        "torch_optim",
    ],
    "checkpoint": [
        "errors",
        "chunks",
        "manifest",
        "cleanup",
        "commit",
        "dcp_files",
        "dcp_io",
        "rng",
        "save",
        "staging",
        "async_save",
        "load",
        "export",
        "dcp_metadata",
        "dcp_import",
        "dcp_export",
    ],
    "interop": [
        "host",
        "module_tree",
        "module_units",
        "module_checks",
        "binding",
        "placeholders",
        "state_hooks",
        "module_layout",
        "module_init",
        "hf_checkpointing",
        "safetensors_format",
        "safetensors_names",
        "safetensors_io",
        "hf_files",
        "hf_export",
        "recompute",
        "hooks",
        "inputs",
        "remat_state",
        "unit_outputs",
        "leaf_check",
        "peft_export",
        "module_state",
        "weights",
        "unit_call",
        "apply",
        "module",
        "jax",
        "orbax",
        "orbax_save",
        "fsdp_names",
        "fsdp_optim",
        "fsdp_checkpoint",
    ],
    "verify": ["report", "batches", "reference", "summary", "verify", "worker", "launch"],
    "cli": [
        "hf_config",
        "model_source",
        "deepspeed",
        "host",
        "largest",
        "tables",
        "mesh_fit",
        "plot",
        "report",
    ],
}
DISTRIBUTED_OK = {"comm", "execute", "optim", "checkpoint", "interop", "calibrate"}
TORCH_FREE = {"spec"}  # pure index math


def _imports(path: Path) -> Iterator[tuple[str, bool]]:
    """Every module ``path`` imports, and whether only under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, id(node) in typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, id(node) in typing_only
            for alias in node.names:  # "from funcshard._src.comm import agree" imports a module
                yield f"{node.module}.{alias.name}", id(node) in typing_only


def _src_modules() -> Iterator[tuple[Path, str, str]]:
    """Every module under _src as (path, its package or layer, its name)."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        if rel.name == "__init__" and len(rel.parts) <= 2:
            continue
        # a package inside a layer (comm/shm/): its modules are "shm.board", its own "shm"
        inner = rel.parts[1:-1] if rel.name == "__init__" else rel.parts[1:]
        yield path, rel.parts[0], ".".join(inner)


def test_layers_import_downward_only():
    problems = []
    files = list(_src_modules())
    assert files
    for path, own, _ in files:
        assert own in LAYERS, f"{path}: add its layer to LAYERS and docs/design.md"
        for name, _ in _imports(path):
            if name.startswith("funcshard._src."):
                other = name.split(".")[2]
                if other != own and LAYERS.get(other, 99) >= LAYERS[own]:
                    problems.append(
                        f"{path.name} imports {name} (layer {other!r} is not below {own!r})"
                    )
            elif name == "funcshard" or (
                name.startswith("funcshard.") and not name.startswith("funcshard._src")
            ):
                problems.append(
                    f"{path.name} imports the public API {name}; import from funcshard._src"
                )
            if name.startswith("torch.distributed") and own not in DISTRIBUTED_OK:
                problems.append(f"{path.name} imports {name}; only {sorted(DISTRIBUTED_OK)} may")
            if name.split(".")[0] == "torch" and own in TORCH_FREE:
                problems.append(f"{path.name} imports {name}; {own} is pure index math")
    assert not problems, "\n".join(problems)


def test_modules_inside_a_package_import_in_one_order():
    """Also under TYPE_CHECKING: a type that a lower module needs from a higher one is a cycle too."""
    problems = []
    for path, package, name in _src_modules():
        if package not in ORDER:
            continue
        order = ORDER[package]
        if name not in order:
            problems.append(f"{package}/{name}.py: add it to ORDER[{package!r}] where it belongs")
            continue
        for imported, _ in _imports(path):
            parts = imported.split(".")
            if parts[:3] != ["funcshard", "_src", package] or len(parts) < 4:
                continue
            sibling = parts[3]
            if len(parts) > 4 and (SRC / package / sibling).is_dir():
                sibling = f"{sibling}.{parts[4]}"
            if sibling in order and order.index(sibling) >= order.index(name):
                problems.append(
                    f"{package}/{name}.py imports {package}/{sibling}.py, which comes after it "
                    f"in {order}"
                )
    assert not problems, "\n".join(problems)


def test_no_import_cycle_anywhere():
    """Over every module of the package, public ones included, at import time."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        graph[module] = {name for name, typing_only in _imports(path) if not typing_only}
    for module, names in graph.items():
        graph[module] = {n for n in names if n in graph and n != module}

    def visit(node: str, trail: list[str], done: set[str]) -> None:
        if node in trail:
            raise AssertionError(
                "import cycle: " + " -> ".join([*trail[trail.index(node) :], node])
            )
        if node in done:
            return
        for nxt in sorted(graph[node]):
            if not (node == "funcshard" or nxt == "funcshard"):  # the root re-exports its parts
                visit(nxt, [*trail, node], done)
        done.add(node)

    done: set[str] = set()
    for module in sorted(graph):
        visit(module, [], done)


def test_only_the_transport_loads_the_shared_memory_package():
    """A plug-in ([Note: transports] in comm/transport.py): no module outside it imports it.

    ``comm/transport.py`` names it as a string and imports it only when chosen.
    """
    package = "funcshard._src.comm.shm"
    inside = SRC / "comm" / "shm"
    problems = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if inside not in path.parents
        for name, _ in _imports(path)
        if name == package or name.startswith(package + ".")
    ]
    assert not problems, "\n".join(problems)


def test_no_lines_packed_past_the_formatter():
    """A size limit is a prompt to split by concept: no formatter pragma (skip, off) packs lines."""
    root = PACKAGE.parent
    sources = [*root.glob("*.py"), *root.glob("*.md")]
    for folder in ("funcshard", "tests", "bench", "examples", "docs"):
        sources += [*(root / folder).rglob("*.py"), *(root / folder).rglob("*.md")]
    marker = "# fmt: " + "(skip|off)"  # split, so this file does not match itself
    packed = [
        f"{p.relative_to(root)}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(marker, line)
    ]
    assert sources
    assert not packed, f"format these lines and split the module by concept instead: {packed}"


def test_a_step_loads_nothing_that_describes_a_plan():
    """[Note: the plan is data] in ``plan/plan.py``: the executor's imports reach no cost, step time, hardware or explanation."""
    describing = {"cost", "cost_model", "estimates", "explain", "step_time", "hardware", "auto"}
    describing |= {"search", "advice", "planner", "presets", "activations", "model_config"}
    reached: dict[str, str] = {}
    todo = [("funcshard._src.execute.value_and_grad", "")]
    while todo:
        name, by = todo.pop()
        path = SRC.parent.joinpath(*name.split(".")[1:])
        path = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
        if name in reached or not path.exists():
            continue
        reached[name] = by
        todo += [(n, name) for n, typing_only in _imports(path) if n.startswith("funcshard.")]
    assert "funcshard._src.plan.plan" in reached
    loaded = {
        n: by for n, by in reached.items() if n.split(".")[-1] in describing and ".plan." in n
    }
    assert not loaded, f"the executor loads what describes a plan (module: its importer): {loaded}"


def test_a_calls_phase_is_assigned_only_in_run():
    """[Note: a call's phase changes only in Run] in ``execute/call_record.py``: no other module assigns ``.phase``."""
    assigning = []
    for path, _, _ in _src_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            if any(isinstance(t, ast.Attribute) and t.attr == "phase" for t in targets):
                assigning.append(f"{path.name}:{getattr(node, 'lineno', '?')}")
    assert assigning, "the test finds no assignment at all: it no longer reads the code"
    assert {a.split(":")[0] for a in assigning} == {"run.py"}, assigning


def _calls_by_module(names: set[str], package: str = "execute") -> dict[str, set[str]]:
    """Per module of ``package``: which of the methods ``names`` it calls (``x.name(...)``)."""
    found: dict[str, set[str]] = {}
    for path, pkg, module in _src_modules():
        if pkg != package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in names
            ):
                found.setdefault(module, set()).add(node.func.attr)
    return found


def test_only_parameter_groups_issue_the_executors_collectives():
    """[Note: one owner per collective]: the executor gathers and reduces only in param_group.py."""
    moving = {"all_gather", "all_gather_pieces", "reduce_scatter", "all_reduce"}
    found = _calls_by_module(moving)
    assert set().union(*found.values()) == moving, "the test no longer reads the collectives"
    assert set(found) == {"param_group"}, found


def test_only_parameter_groups_move_a_units_state():
    """[Note: a unit's state is moved by its group alone] in ``execute/unit_state.py``: its transitions are the group's to call."""
    transitions = {
        "mark_gathering",
        "mark_gathered",
        "hold",
        "unhold",
        "drop_holders",
        "reset_after_error",
        "materialize",
        "forget",
    }
    found = _calls_by_module(transitions)
    assert found.get("param_group") == transitions, "the test no longer reads the transitions"
    assert set(found) == {"param_group"}, found
    assigning = [
        f"{path.name}:{node.lineno}"
        for path, pkg, _ in _src_modules()
        if pkg == "execute"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "state" for t in node.targets)
    ]
    assert assigning, "the test finds no assignment at all: it no longer reads the code"
    assert {a.split(":")[0] for a in assigning} == {"unit_state.py"}, assigning


def test_gradients_without_communication_import_nothing_from_comm():
    """[Note: gradients without communication] in execute/gradients.py."""
    path = SRC / "execute" / "gradients.py"
    comm = [name for name, _ in _imports(path) if name.startswith("funcshard._src.comm")]
    assert comm == [], comm
