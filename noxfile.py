"""Every check has one entry point: ``nox -s <session>``; each session forwards its arguments.

Sessions install torch from the CPU constraint ``.ci/constraints-cpu.txt``
(``torch==2.13.0``). GPU users point ``FUNCSHARD_CONSTRAINTS`` at their own file,
or set it empty to let pip choose (a CUDA build): ``FUNCSHARD_CONSTRAINTS= nox -s tests``.
"""

from __future__ import annotations

import math
import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "doctest"]
nox.options.reuse_venv = "yes"
nox.options.default_venv_backend = "venv"

CONSTRAINTS = os.environ.get("FUNCSHARD_CONSTRAINTS", ".ci/constraints-cpu.txt")
# The torch versions `torch_range` checks: the oldest that pyproject.toml claims and the
# newest known. Its floor (`torch>=2.11`) moves only with the first entry here.
TORCH_RANGE = ["2.11.0", "2.14.1"]
# A fast subset across the layers that lean on torch's own APIs: flat buffers and storage
# resizing, the executor and autograd, DCP checkpoints, the demo, FSDP2/FSDP1/DDP (bench,
# bench.gpu's CPU fallback) and torch's fake process group.
TORCH_RANGE_TESTS = [
    "tests/test_flat.py",
    "tests/test_shard.py",
    "tests/test_unit_state.py",
    "tests/test_value_and_grad.py",
    "tests/test_checkpoint.py",
    "tests/test_examples.py",
    "tests/test_bench.py",
    "tests/test_fake_process_group.py",
    "tests/test_pending.py",
    "tests/test_runtime.py",
    "tests/test_buffers.py",
    "tests/test_preflight.py",
]


def _install(session: nox.Session, *extras: str) -> None:
    pins = ["-c", CONSTRAINTS] if CONSTRAINTS else []
    target = f".[{','.join(extras)}]" if extras else "."
    session.install(*pins, "-e", target)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (single- and multi-process on CPU gloo); JAX-oracle tests run in `interop`."""
    _install(session, "test")
    session.run(
        "pytest",
        *(
            session.posargs
            or [
                "tests",
                "--ignore=tests/interop",
                "--ignore=tests/torchtitan",
                "-m",
                "not slow and not matrix",
            ]
        ),
    )


@nox.session
def conformance(session: nox.Session) -> None:
    """The whole conformance matrix: every row under every variant, and through every checkpoint
    path at W=2 and W=1 (CI runs a subset)."""
    _install(session, "test")
    session.run(
        "pytest",
        "tests/test_conformance.py",
        "tests/test_conformance_checkpoints.py",
        *session.posargs,
    )


@nox.session
def slow(session: nox.Session) -> None:
    """The tests that compile with Inductor (minutes each): ``-m slow``."""
    _install(session, "test")
    session.run(
        "pytest",
        "tests",
        "--ignore=tests/interop",
        "--ignore=tests/torchtitan",
        "-m",
        "slow",
        *session.posargs,
    )


@nox.session(name="torch_range")
@nox.parametrize("torch", TORCH_RANGE)
def torch_range(session: nox.Session, torch: str) -> None:
    """The oldest and newest torch in range on a fast subset of the tests (CI: weekly, not .ci/run).

    Not pinned by the CPU constraint: each version comes as pip finds it (``torch==2.14.1``
    from PyPI is a CUDA build of several GB); ``FUNCSHARD_TORCH_INDEX`` names an index for
    the torch wheel alone, e.g. ``https://download.pytorch.org/whl/cpu``.
    """
    index = os.environ.get("FUNCSHARD_TORCH_INDEX")
    session.install(f"torch=={torch}", *(["--index-url", index] if index else []))
    session.install("-e", ".[test]", f"torch=={torch}")  # the torch just installed satisfies it
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    session.run("pytest", *(session.posargs or TORCH_RANGE_TESTS))


@nox.session
def interop(session: nox.Session) -> None:
    """Tests with JAX (CPU, eight host devices), Hugging Face, peft and Orbax as oracles."""
    _install(session, "test", "jax", "hf", "orbax")
    # orbax-checkpoint writes the test checkpoints, optax is the schedules' oracle and peft
    # loads the adapters save_pretrained writes; funcshard needs none of them
    session.install("orbax-checkpoint", "optax", "peft")
    session.run("pytest", *(session.posargs or ["tests/interop"]))


@nox.session
def torchtitan(session: nox.Session) -> None:
    """torchtitan 0.3's llama3 (fused QKV) checkpointed by funcshard and by torchtitan, both ways.

    torchtitan comes without its dependencies (they would replace the pinned torch),
    with the few its model code imports: tyro, and triton, which it imports at module
    import (a CPU machine installs it from PyPI and never runs it).
    """
    _install(session, "test")
    pins = ["-c", CONSTRAINTS] if CONSTRAINTS else []
    session.install(
        *pins, "--no-deps", "torchtitan==0.3.0", "spmd_types==0.2.3", "torch_checkpointing"
    )
    session.install(*pins, "tyro", "triton")
    session.run("pytest", *(session.posargs or ["tests/torchtitan"]))


@nox.session
def doctest(session: nox.Session) -> None:
    """Runs the examples in every docstring."""
    _install(session, "test")
    session.run("pytest", "--doctest-modules", "funcshard", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """pyright: strict on spec and plan, basic elsewhere."""
    _install(session, "test", "dev")
    session.run("pyright", *session.posargs)


@nox.session
def stress(session: nox.Session) -> None:
    """Resume after SIGKILL at every kill point 10x, 32 kills mid-save, a 200-step soak (W=2; minutes)."""
    _install(session, "test")
    session.run("python", "-m", "tests.stress", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark against PyTorch FSDP2, FSDP1 and DDP; writes bench/results/ (a quick run: -- --tiny)."""
    _install(session, "bench")
    session.run("python", "-m", "bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: sharded training of a small GPT on CPU processes (torchrun, gloo).

    Two processes, or as many as ``--mesh`` names (``-- --mesh dp=2,fsdp=2``: four).
    """
    _install(session, "examples")
    session.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        str(demo_ranks(session.posargs)),
        "examples/train_gpt.py",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


def demo_ranks(posargs: list[str]) -> int:
    """The processes ``nox -s demo`` starts: the product of ``--mesh``'s sizes, else 2."""
    mesh = None
    for k, arg in enumerate(posargs):
        if arg == "--mesh" and k + 1 < len(posargs):
            mesh = posargs[k + 1]
        elif arg.startswith("--mesh="):
            mesh = arg.split("=", 1)[1]
    if mesh is None:
        return 2
    sizes = [part.split("=")[-1].strip() for part in mesh.split(",")]
    if not all(size.isdigit() and int(size) > 0 for size in sizes):
        return 2  # train_gpt.py refuses the mesh, saying how to write one
    return math.prod(int(size) for size in sizes)
