"""Layers import downward only, and only the runtime layers touch torch.distributed.

Order (docs/design.md §3): tree, spec, plan, comm, shard, execute, then
optim / checkpoint / interop, then the command line. A failure names the module
and the import that breaks the order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import funcshard

SRC = Path(funcshard.__file__).parent / "_src"
LAYERS = {
    "tree": 0,
    "spec": 1,
    "plan": 2,
    "comm": 3,
    "shard": 4,
    "execute": 5,
    "optim": 6,
    "checkpoint": 6,
    "interop": 7,
    "cli": 8,
}
DISTRIBUTED_OK = {"comm", "execute", "optim", "checkpoint", "interop"}
TORCH_FREE = {"spec"}  # pure index math


def _layer(module: str) -> str:
    return module.split(".")[2] if module.count(".") >= 2 else module


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_layers_import_downward_only():
    problems = []
    files = sorted(SRC.rglob("*.py"))
    assert files
    for path in files:
        rel = path.relative_to(SRC).with_suffix("")
        own = rel.parts[0] if len(rel.parts) > 1 else rel.name
        if own == "__init__":
            continue
        assert own in LAYERS, f"{rel}: add its layer to LAYERS and docs/design.md"
        for name in _imports(path):
            if name.startswith("funcshard._src."):
                other = name.split(".")[2]
                if other != own and LAYERS.get(other, 99) >= LAYERS[own]:
                    problems.append(f"{rel} imports {name} (layer {other!r} is not below {own!r})")
            elif name == "funcshard" or (
                name.startswith("funcshard.") and not name.startswith("funcshard._src")
            ):
                problems.append(f"{rel} imports the public API {name}; import from funcshard._src")
            if name.startswith("torch.distributed") and own not in DISTRIBUTED_OK:
                problems.append(f"{rel} imports {name}; only {sorted(DISTRIBUTED_OK)} may")
            if name.split(".")[0] == "torch" and own in TORCH_FREE:
                problems.append(f"{rel} imports {name}; {own} is pure index math")
    assert not problems, "\n".join(problems)
