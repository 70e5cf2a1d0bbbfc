"""``fs.value_and_grad``: a sharded training step over a pure loss function."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from funcshard._src import tree
from funcshard._src.comm import collectives, groups, runtime
from funcshard._src.comm.collectives import Ledger
from funcshard._src.execute.gradients import PartKey, take_donated
from funcshard._src.execute.param_group import (
    BufferPool,
    ParamGroup,
    Reducer,
    chunk_bytes_for,
    default_bucket_bytes,
    make_groups,
    plan_groups,
)
from funcshard._src.execute.run import (
    Run,
    RunMode,
    check_end,
    check_start,
    settle_after_error,
    signature,
    start_forward_check,
    step_run,
)
from funcshard._src.execute.unit_state import GatheredMemory, UnitRuntime
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision
from funcshard._src.plan.quantize import Quantized, quantize_for
from funcshard._src.shard.flat import FlatLayout
from funcshard._src.shard.shard import plan_layouts
from funcshard._src.shard.sharded import FlatShard, ShardedTensor

Accumulation = Literal["sharded", "unsharded"]


@dataclass(frozen=True)
class StepStats:
    """What the last call of a step held and moved on this rank."""

    peak_gathered_bytes: int  # gathered parameters (and all-gather buffers) alive at once, at most
    unit_gathered_bytes: dict[str, int]  # per unit, bytes of its full leaves when gathered
    staging_bytes: int = 0  # staging buffers kept for the next call (none after a training step); see [Note: staging lifetimes] in ``execute/param_group.py``
    # two-hop reductions' partial gradients alive at once, at most ([Note: two-hop reductions] in ``execute/param_group.py``)
    peak_partial_grad_bytes: int = 0


class Step:
    """A sharded ``value_and_grad`` of ``loss_fn``; build it with :func:`value_and_grad`."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        plan: Plan,
        *,
        has_aux: bool,
        mixed_precision: MixedPrecision,
        prefetch: int,
        donate_grads: bool = False,
        bucket_bytes: int | None = None,
        quantize: Quantized | None = None,
    ) -> None:
        if quantize is not None and not isinstance(quantize, Quantized):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"quantize must be a fs.Quantized(...) or None, got {quantize!r}")
        self.quantize = quantize
        if prefetch < 0:
            raise ValueError(f"prefetch must be at least 0, got {prefetch}")
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or bucket_bytes < 0):
            raise ValueError(
                f"bucket_bytes must be a number of bytes of at least 0 (0: no buckets), got {bucket_bytes!r}"
            )
        self.bucket_bytes = bucket_bytes
        self.loss_fn = loss_fn
        self.plan = plan
        self.has_aux = has_aux
        self.mixed_precision = mixed_precision
        self.prefetch = prefetch
        self._partial_peak = 0  # the last call's StepStats.peak_partial_grad_bytes
        self.donate_grads = donate_grads
        self.ledger = Ledger()
        self.memory = GatheredMemory()
        # staging buffers, see [Note: staging lifetimes] in ``execute/param_group.py``: all-gather outputs, reduce-scatter inputs
        self.gather_pool = BufferPool(depth=max(1, prefetch))
        self.reduce_pool = BufferPool(depth=1)
        self._layouts = plan_layouts(plan)
        self._fingerprint = plan.fingerprint()  # asked once: the plan is data, never changed
        self._world_size = plan.mesh.size
        self._units: list[UnitRuntime] | None = None
        # which units form each parameter group, decided with the units; each call makes its
        # groups from it ([Note: a group lives for one step] in param_group.py)
        self._members: list[list[UnitRuntime]] = []
        self._chunk_bytes = 0  # [Note: reductions in chunks] in param_group.py, made with the units
        # the gradients last returned, by part, with donate_grads
        self._last: list[tuple[PartKey, FlatShard]] = []
        # the call order of the last step, which forward prefetches follow; none before the
        # first (the plan's tree order is a guess, wrong for {"embed", "blocks", "head"}
        # and for Hugging Face models, and a wrong prefetch costs a re-gather)
        self._order: list[str] = []

    @property
    def stats(self) -> StepStats:
        """Memory figures of the last call on this rank."""
        units = self._runtimes()
        return StepStats(
            self.memory.peak,
            {u.name: u.gathered_bytes for u in units},
            self.gather_pool.held_bytes + self.reduce_pool.held_bytes,
            self._partial_peak,
        )

    def __call__(self, sparams: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``(loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``) for this rank's batch.

        ``loss`` is this rank's loss; ``grads`` are sharded like ``sparams`` and are the
        mean over every rank of the mesh (``None`` at frozen leaves).
        """
        (losses, auxes), grads = self._run(sparams, [(args, kwargs)], "sharded")
        return ((losses[0], auxes[0]) if self.has_aux else losses[0]), grads

    def accumulate(
        self, sparams: Any, micro_batches: Sequence[Any], /, *, mode: Accumulation = "sharded"
    ) -> tuple[Any, Any]:
        """Gradients over several micro-batches before one optimizer step.

        Each item of ``micro_batches`` is the argument tuple of one ``loss_fn`` call
        (a non-tuple item is a single argument). Returns ``(loss, grads)``: the mean
        loss over the micro-batches (with ``has_aux``, ``((loss, [aux, ...]), grads)``)
        and gradients that are the mean over micro-batches and ranks.

        Args:
            sparams: the sharded params.
            micro_batches: one entry per micro-batch.
            mode: ``"sharded"`` reduce-scatters every micro-batch into the sharded
                gradients (lowest memory); ``"unsharded"`` keeps each unit's full
                gradients locally and reduces once after the last micro-batch (least
                communication, like FSDP's ``no_sync``; a full copy of the gradients
                per rank).
        """
        if mode not in ("sharded", "unsharded"):
            raise ValueError(f"accumulate: mode must be 'sharded' or 'unsharded', got {mode!r}")
        if not micro_batches:
            raise ValueError("accumulate: micro_batches is empty; give at least one")
        batches = [(b if isinstance(b, tuple) else (b,), {}) for b in micro_batches]
        (losses, auxes), grads = self._run(sparams, batches, mode)
        loss = torch.stack(losses).mean()
        return ((loss, auxes) if self.has_aux else loss), grads

    def release(self) -> None:
        """Frees what the step keeps between calls (its staging buffers); mutates. Local: no collective.

        Between calls a step keeps at most its staging pools (``stats.staging_bytes``,
        a few units' collective buffers after an evaluation; a training step drains them, see
        [Note: staging lifetimes] in ``execute/param_group.py``); gathered parameters and
        gradients are never kept. The next call allocates them
        again. Dropping the step frees the same.

        Example:
            >>> import torch, funcshard as fs
            >>> plan = fs.plan({"w": torch.ones(2)}, fs.Mesh({"fsdp": 1}))
            >>> step = fs.value_and_grad(lambda p: p["w"].sum(), plan)
            >>> _ = step(fs.shard({"w": torch.ones(2)}, plan))
            >>> step.release()
            >>> step.stats.staging_bytes
            0
        """
        if step_run() is not None:
            raise RuntimeError(
                "step.release() was called inside a running step; call it between steps"
            )
        self.gather_pool.clear()
        self.reduce_pool.clear()

    def forward(self, sparams: Any, /, *args: Any, **kwargs: Any) -> Any:
        """What ``loss_fn(sparams, *args, **kwargs)`` returns, evaluated without gradients.

        The same gather, compute, free schedule and prefetch as a step's forward,
        under ``torch.no_grad``: each unit call gathers its unit (prefetching the
        next) and frees it right after, whatever its strategy; no activation is
        kept for backward and nothing is re-gathered or reduced. Collective:
        every rank calls it, as a step.
        """
        with runtime.held_settings():  # [Note: settings held through a step] in comm/runtime.py
            groups, by_unit = self._start(
                sparams,
                "forward only",
                nested="an evaluation was called inside a step's loss_fn; call them one after the other",
                batches=[(args, kwargs)],
            )
            self.memory.peak = self.memory.current
            run = Run(
                groups,
                mode=RunMode.EVALUATION,
                order_hint=self._order,
                prefetch=self.prefetch,
                reducer=Reducer(world_size=self._world_size, spares={}),
                output_dtype=self.mixed_precision.output_dtype,
                param_dtype=self.mixed_precision.param_dtype,
            )
            try:
                with torch.no_grad():
                    view = run.begin(sparams, by_unit)
                    out = self.loss_fn(view, *args, **kwargs)
                    calls = run.end_forward()
                start_forward_check(calls).finish()
                self._order = calls
                run.close_evaluation()
            except BaseException as error:
                settle_after_error(run.abort(), error)
                raise
        return out

    # -- internals ---------------------------------------------------------------

    def _runtimes(self) -> list[UnitRuntime]:
        if self._units is None:
            bound = groups.bind(self.plan.mesh)
            by_unit: dict[str, list[Any]] = {}
            for layout in self._layouts:
                by_unit.setdefault(layout.unit, []).append(layout)
            self._units = [
                UnitRuntime(
                    unit,
                    by_unit[unit.name],
                    bound,
                    self.mixed_precision,
                    self.ledger,
                    self.memory,
                    quantize_for(self.quantize, unit.name),
                )
                for unit in self.plan.units
            ]
            backend = str(dist.get_backend()) if bound.distributed else None
            limit = (
                default_bucket_bytes(backend) if self.bucket_bytes is None else self.bucket_bytes
            )
            self._members = plan_groups(self._units, limit)
            self._chunk_bytes = chunk_bytes_for(self._units)
        return self._units

    def _run(
        self,
        sparams: Any,
        batches: list[tuple[tuple[Any, ...], dict[str, Any]]],
        mode: Accumulation,
    ) -> tuple[tuple[list[torch.Tensor], list[Any]], Any]:
        with runtime.held_settings():  # [Note: settings held through a step] in comm/runtime.py
            return self._run_held(sparams, batches, mode)

    def _run_held(
        self,
        sparams: Any,
        batches: list[tuple[tuple[Any, ...], dict[str, Any]]],
        mode: Accumulation,
    ) -> tuple[tuple[list[torch.Tensor], list[Any]], Any]:
        groups, by_unit = self._start(
            sparams,
            f"{mode}, {len(batches)} micro-batch(es)",
            nested="a step was called inside another step's loss_fn; call steps one after the other",
            batches=batches,
        )
        reducer = Reducer(
            world_size=self._world_size,
            spares=self._take_donated(),
            hold_leaves=len(batches) == 1,
            chunk_bytes=self._chunk_bytes,
        )
        losses: list[torch.Tensor] = []
        auxes: list[Any] = []
        for i, (args, kwargs) in enumerate(batches):
            self.memory.peak = self.memory.current
            run = Run(
                groups,
                mode=RunMode.of_micro_batch(i, len(batches), keep_whole=mode == "unsharded"),
                order_hint=self._order,
                prefetch=self.prefetch,
                reducer=reducer,
                output_dtype=self.mixed_precision.output_dtype,
                param_dtype=self.mixed_precision.param_dtype,
            )
            try:
                with torch.enable_grad():
                    view = run.begin(sparams, by_unit)
                    out = self.loss_fn(view, *args, **kwargs)
                    calls = run.end_forward()
                    loss, aux = split_loss(out, has_aux=self.has_aux)
                    run.forward_check = start_forward_check(calls)
                    self._order = calls
                    torch.autograd.backward(loss)
                run.finish()
                check_end()
            except BaseException as error:
                settle_after_error(run.abort(), error)
                raise
            losses.append(loss.detach())
            auxes.append(aux)
        self._partial_peak = reducer.partial_peak
        shards = [
            (part, flat)
            for unit in self._runtimes()
            for part, flat in zip(unit.parts, by_unit.get(unit.name, ()))
        ]
        sharded_grads = reducer.gradients.tree(sparams, shards, micro_batches=len(batches))
        if self.donate_grads:
            self._last = reducer.gradients.returned
        return (losses, auxes), sharded_grads

    def _start(
        self, sparams: Any, accumulation: str, *, nested: str, batches: list[Any]
    ) -> tuple[list[ParamGroup], dict[str, list[FlatShard]]]:
        """What every call of a step or evaluation does first; collective (the start agreement).

        Refuses a call inside a running step (``nested``: the message), checks ``sparams``
        and ``batches`` (plan, devices), agrees with every rank on the signature; returns
        every unit's parameter group and this call's flat shards by unit.
        """
        if step_run() is not None:
            raise RuntimeError(nested)
        self._runtimes()
        by_unit = shards_by_unit(sparams, self.plan, self._layouts, batches=batches)
        check_start(
            signature(
                self._fingerprint,
                mixed_precision=self.mixed_precision,
                prefetch=self.prefetch,
                accumulation=accumulation,
                order=self._order,
            )
        )
        # every rank is past the last step's collectives: the transport lets go of what it
        # holds for them that every peer has read (a shared-memory region, comm/shm/regions.py)
        collectives.settle()
        return make_groups(self._members, self.gather_pool, self.reduce_pool), by_unit

    def _take_donated(self) -> dict[PartKey, torch.Tensor]:
        """With ``donate_grads``: the last call's gradient buffers, for this call's; see [Note: donation] in ``shard/sharded.py``.

        Mutates the last returned gradient tree (it is donated: reading it raises).
        """
        last, self._last = self._last, []
        return take_donated(last)


def value_and_grad(
    loss_fn: Callable[..., Any],
    plan: Plan,
    /,
    *,
    has_aux: bool = False,
    mixed_precision: MixedPrecision | None = None,
    prefetch: int = 1,
    donate_grads: bool = False,
    bucket_bytes: int | None = None,
    quantize: Quantized | None = None,
) -> Step:
    """A training step ``step(sparams, *args) -> (loss, grads)`` for the pure ``loss_fn(params, *args)``.

    Every rank runs ``loss_fn`` on its own batch. Leaves of the root unit arrive as
    full tensors; each unit's subtree is used through :func:`funcshard.call`, which
    gathers it just before it runs and frees it after. Backward re-gathers units as
    it reaches them and reduce-scatters their gradients, so ``grads`` are sharded
    like ``sparams`` and equal the mean over every rank's batch. Frozen leaves
    (``fs.plan(..., frozen=...)``) are gathered like the others but get no
    gradient: ``grads`` holds ``None`` there, and optimizers skip them.

    Args:
        loss_fn: ``loss_fn(params, *args)`` returning a scalar loss (or ``(loss, aux)``).
        plan: the plan ``sparams`` were sharded with.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns ``((loss, aux), grads)``.
        mixed_precision: compute, gather and reduce dtypes; default: the stored dtypes.
        prefetch: units whose all-gather starts ahead of use (forward and backward);
            gathered parameters alive at once are at most the root unit plus
            ``1 + prefetch`` units.
        donate_grads: donate the gradients each call returns to the next call, which
            writes its gradients into those buffers instead of fresh memory (faster:
            no new pages each step). The donated tree is dead: reading it raises
            ``DonatedError``; clone what you keep. Without it, no tree a call
            returned is ever written again. Units in a bucket (``bucket_bytes``)
            reduce into one new buffer per bucket; ``bucket_bytes=0`` donates all.
            A unit on a mesh of one rank returns autograd's own gradient tensors
            (docs/executor.md, "Local-only units"): nothing to write into, but its
            donated tree is dead all the same.
        bucket_bytes: consecutive units whose full leaves together stay within this
            many bytes share their all-gathers and reductions (as DDP buckets its
            all-reduces), which cuts the latency of small units; ``0`` turns it off.
            ``None`` is the backend's default (4 MiB on gloo, off on NCCL). Gathered
            parameters alive at once are then bounded by buckets instead of units.
        quantize: low-bit all-gathers of parameters and reductions of gradients
            (int8, int4 or fp8), per block with an fp32 scale, for the units it names
            (ZeRO++'s qwZ and qgZ; see ``fs.Quantized``): int8 sends about a quarter
            of fp32's bytes, each value within ``max|block| / 254`` of the exact one.
            Shards, optimizer state and the update stay exact.
            ``CostModel(quantize=...)`` counts the same bytes.

    Returns:
        A :class:`Step`; also see :meth:`Step.accumulate` for several micro-batches.

    Example:
        >>> import torch, funcshard as fs
        >>> params = {"w": torch.ones(3)}
        >>> plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
        >>> step = fs.value_and_grad(lambda p, x: (p["w"] * x).sum(), plan)
        >>> loss, grads = step(fs.shard(params, plan), torch.arange(3.0))
        >>> loss, grads["w"].local
        (tensor(3.), tensor([0., 1., 2.]))
    """
    return Step(
        loss_fn,
        plan,
        has_aux=has_aux,
        mixed_precision=mixed_precision or FULL_PRECISION,
        prefetch=prefetch,
        donate_grads=donate_grads,
        bucket_bytes=bucket_bytes,
        quantize=quantize,
    )


# -- what a step accepts and what loss_fn returns ----------------------------------------
# What a step accepts as params: the plan's tree of this rank's sharded leaves, found by unit.


def shards_by_unit(
    sparams: Any,
    plan: Plan,
    layouts: Sequence[FlatLayout],
    /,
    *,
    batches: Sequence[tuple[tuple[Any, ...], dict[str, Any]]] = (),
) -> dict[str, list[FlatShard]]:
    """``sparams``' flat shards by unit (one per part, in ``layouts``' order), if sharded with ``plan``.

    The shards, and the tensors of ``batches`` (:func:`check_devices`), must be
    on a device the backend carries.

    Raises:
        ValueError: another tree structure, shards of another plan or rank, or a
            shard or batch tensor on a device the backend cannot carry.
        TypeError: a leaf that is not sharded.
    """
    leaves, treedef = tree.flatten(sparams)
    if treedef != plan.treedef:
        raise ValueError(
            "the params passed to the step do not have the plan's tree structure; pass the tree "
            "fs.shard(params, plan) returned (or an optimizer's update of it)"
        )
    if not all(isinstance(leaf, ShardedTensor) for leaf in leaves):
        paths, leaves, _ = tree.flatten_with_paths(sparams)
        path, leaf = next((p, x) for p, x in zip(paths, leaves) if not isinstance(x, ShardedTensor))
        raise TypeError(
            f"{path or '<root>'}: the step needs sharded params (from fs.shard), got a "
            f"{type(leaf).__name__}"
        )
    rank = runtime.rank()  # the mesh's rank order is the world's (comm/groups.py)
    # by (unit, dtype, frozen): a layout's identity in a plan, hashed without a Python call
    found: dict[tuple[str, torch.dtype, bool], FlatShard] = {}
    expected = {(lt.unit, lt.dtype, lt.frozen): lt for lt in layouts}
    for flat in dict.fromkeys(leaf.flat for leaf in leaves):  # flats_of, without a flatten
        key = (flat.layout.unit, flat.layout.dtype, flat.layout.frozen)
        layout = expected.get(key)
        if (
            layout is None
            or (flat.layout is not layout and flat.layout != layout)
            or flat.rank != rank
        ):
            raise ValueError(
                f"unit {flat.layout.unit!r}: the params were sharded with another plan or rank than "
                f"this step's (plan fingerprint {plan.fingerprint()}); shard them with this plan"
            )
        found[key] = flat
    by_unit: dict[str, list[FlatShard]] = {}
    for key in expected:  # each unit's parts in the order of its runtime's
        if key in found:
            by_unit.setdefault(key[0], []).append(found[key])
    check_devices(by_unit, batches)
    return by_unit


def check_devices(
    by_unit: dict[str, list[FlatShard]],
    batches: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    /,
) -> None:
    """Refuses shards or batch tensors on a device the backend cannot carry, before any collective.

    ``batches``: each call's ``(args, kwargs)`` after the params; argument paths
    count from 0 after the params (``loss_fn's argument 0`` is the first).

    See [Note: devices and backends] in ``comm/runtime.py``; nothing to check
    outside a distributed run or under the fake process group.

    Raises:
        ValueError: names the unit or the batch leaf, its device, the backend and the fix.
    """
    if runtime.backend() in (None, "fake"):
        return
    runtime.check_tensors(
        (
            (f"{flat.layout.slots[0].path} (unit {unit!r})", flat.data)
            for unit, flats in by_unit.items()
            for flat in flats
            if flat.layout.slots
        ),
        "the params",
    )
    for i, (args, kwargs) in enumerate(batches):
        where = f"micro-batch {i}" if len(batches) > 1 else "the batch"
        for kind, part in (("argument", args), ("keyword argument", kwargs)):
            paths, leaves, _ = tree.flatten_with_paths(part)
            runtime.check_tensors(
                (
                    (f"loss_fn's {kind} {p}", x)
                    for p, x in zip(paths, leaves)
                    if isinstance(x, torch.Tensor)
                ),
                where,
            )


# What ``loss_fn`` returned: the loss (and aux), checked before backward runs.


def split_loss(out: Any, *, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` from what ``loss_fn`` returned, checked: a floating scalar that needs grad."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"has_aux=True: loss_fn must return (loss, aux), got {type(out).__name__}"
            )
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        hint = (
            "; to return (loss, aux), pass has_aux=True"
            if not has_aux and isinstance(loss, tuple)
            else ""
        )
        raise TypeError(
            f"loss_fn must return a floating-point scalar tensor as the loss, got {_kind(loss)}{hint}"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on any parameter (it does not require grad); use the params "
            "loss_fn receives, through fs.call for unit leaves"
        )
    return loss.reshape(()), aux


def _kind(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"
