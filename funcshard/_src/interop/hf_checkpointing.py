"""Hugging Face gradient checkpointing and caches under ``apply``: found, handed to remat, or refused.

[Note: Hugging Face checkpointing]
``model.gradient_checkpointing_enable()`` sets a truthy ``gradient_checkpointing``
attribute on submodules: on each ``GradientCheckpointingLayer`` (newer transformers:
the layer checkpoints its own ``forward``) and on the stacks holding the layers
(older transformers: ``LlamaModel`` checkpoints each layer it runs; newer ones only
turn ``use_cache`` off there). Either way HF recomputes a layer in backward by
calling its forward again, after ``torch.func.functional_call`` has put the module's
own parameters back: the recompute reads stale (or ``meta``) weights, and the
gradients are silently wrong. So ``apply`` never lets HF checkpoint: every flag is
``False`` while apply runs in a step and while a unit recomputes, and restored exactly
after. (``fs.testing``'s plain reference, outside any step, leaves the flags as they
are: there a recompute re-enters the binding, [Note: activation checkpoints under
apply] in ``recompute.py``.)
funcshard's own remat (``fs.call(..., remat=True)``) recomputes a unit with its
gathered parameters instead, so checkpointing is translated into ``remat=True``
where every checkpointed layer is a unit or inside one, and refused where one is
not (nothing would recompute it correctly).

A recomputed forward must save the same tensors as the original one, so a cache
filled in forward must not be filled again: in a rematerialized step, as HF's own
checkpointing does, a unit's forward gets ``use_cache=False`` and no cache kwargs,
and the top-level forward ``use_cache=False`` unless the caller set it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from funcshard._src.execute.run import current_run

__all__ = [
    "CacheOff",
    "cache_off",
    "checked_at_apply",
    "checkpointed",
    "checkpointing_off",
    "resolve_remat",
]

_FLAG = "gradient_checkpointing"
# the names HF layers give a cache argument (``past_key_values`` became ``cache`` in 5.x)
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")
_MISSING = object()
_NEWER = " (activation_checkpointing_disable() in newer transformers)"


def checkpointed(module: nn.Module, /) -> list[tuple[str, nn.Module]]:
    """``(path, submodule)`` of every submodule (``module`` included) whose HF checkpointing is on.

    Paths use ``/`` like the params (``model/layers/0``; ``""`` is ``module``).

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
        >>> net[1].gradient_checkpointing = True
        >>> [path for path, _ in checkpointed(net)]
        ['1']
    """
    return [(name.replace(".", "/"), m) for name, m in module.named_modules() if _flag_on(m)]


def resolve_remat(module: nn.Module, unit_paths: Sequence[str], /, *, remat: bool) -> bool:
    """Whether ``apply`` rematerializes its units: ``remat``, or ``True`` if HF checkpointing is on.

    See [Note: Hugging Face checkpointing].

    Raises:
        ValueError: HF checkpointing is on in a layer that no unit holds; the message
            names the layer and the fix (units with ``remat=True``, or
            ``model.gradient_checkpointing_disable()``).
    """
    flagged = checkpointed(module)
    if not flagged:
        return remat
    uncovered = _uncovered(flagged, unit_paths)
    if uncovered:
        raise ValueError(_refusal("functionalize", module, uncovered))
    return True


def checked_at_apply(
    module: nn.Module, unit_paths: Sequence[str], /, *, remat: bool
) -> list[tuple[str, nn.Module]]:
    """:func:`checkpointed`, refusing an apply where HF would checkpoint what funcshard cannot recompute.

    HF checkpoints only a module in training mode with grad enabled; elsewhere its
    flags change nothing (and ``apply`` turns them off anyway).

    Raises:
        ValueError: checkpointing is on (enabled after :func:`functionalize`) in a
            layer that no unit holds, or while the units are not rematerialized.
    """
    flagged = checkpointed(module)
    live = [(path, m) for path, m in flagged if m.training] if torch.is_grad_enabled() else []
    if not live:
        return flagged
    uncovered = _uncovered(live, unit_paths)
    if uncovered:
        raise ValueError(_refusal("apply", module, uncovered))
    if not remat:
        raise ValueError(
            f"apply: Hugging Face gradient checkpointing is on in {_where(module, live)}, but "
            f"functionalize made this apply with remat=False (checkpointing was enabled after "
            f"functionalize); its recompute would read stale weights. Functionalize the model "
            f"again (with checkpointing on it rematerializes the units: remat=True), or call "
            f"model.gradient_checkpointing_disable(){_NEWER}"
        )
    return flagged


@contextlib.contextmanager
def checkpointing_off(modules: Iterable[nn.Module], /) -> Iterator[None]:
    """Sets each module's ``gradient_checkpointing`` to ``False`` while it runs; mutates the modules.

    On exit (return or error) each module gets back exactly what it had: its own
    attribute value, or none (the class's default shows again).

    Example:
        >>> lin = nn.Linear(1, 1)
        >>> lin.gradient_checkpointing = True
        >>> with checkpointing_off([lin]):
        ...     lin.gradient_checkpointing
        False
        >>> lin.gradient_checkpointing
        True
    """
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for m in modules:
            instance = vars(m)
            saved.append((m, instance.get(_FLAG, _MISSING)))
            instance[_FLAG] = False
        yield
    finally:
        for m, value in reversed(saved):
            if value is _MISSING:
                del vars(m)[_FLAG]
            else:
                vars(m)[_FLAG] = value


@dataclasses.dataclass(frozen=True)
class CacheOff:
    """Turns Hugging Face caches off in a rematerialized step (see [Note: Hugging Face checkpointing]).

    Outside a step, without grad, or with ``remat=False`` nothing recomputes, and
    the kwargs pass unchanged; so they do for a module that is not a HF model (the default).
    """

    hugging_face: bool = False
    # the top-level forward's signature when it takes ``use_cache``, else None
    signature: inspect.Signature | None = None

    def top_level(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], /, *, remat: bool
    ) -> dict[str, Any]:
        """``kwargs`` of the module's forward, with ``use_cache=False`` if the caller set none.

        Raises:
            ValueError: the caller asked for a cache (``use_cache=True``) in a step with
                remat, where each unit runs without one: it would come back empty.
        """
        if self.signature is None or not _recomputes(remat):
            return kwargs
        try:
            given = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # let the forward itself report its wrong arguments
            return kwargs
        if "use_cache" in given:
            if given["use_cache"]:
                raise ValueError(
                    "use_cache=True in a training step with remat (functionalize(..., "
                    "remat=True) or gradient_checkpointing_enable()): each unit recomputes in "
                    "backward and runs without a cache, as Hugging Face's own checkpointing "
                    "does, so the cache would come back empty. Fix: pass use_cache=False in "
                    "training, or functionalize without remat to train with a cache"
                )
            return kwargs
        return {**kwargs, "use_cache": False}

    def unit(self, module: nn.Module, kwargs: dict[str, Any], /, *, remat: bool) -> dict[str, Any]:
        """``kwargs`` of one unit's forward with ``use_cache=False`` and no cache, as HF's checkpointing does.

        A layer that only reads the cache (HF's ``_can_checkpoint_with_cache``) keeps it.
        """
        if not self.hugging_face or not _recomputes(remat):
            return kwargs
        out = dict(kwargs)
        if out.get("use_cache"):
            out["use_cache"] = False
        if not getattr(module, "_can_checkpoint_with_cache", False):
            for name in _CACHE_KWARGS:
                if out.get(name) is not None:
                    out[name] = None
        return out


def cache_off(module: nn.Module, /) -> CacheOff:
    """The cache handling for ``module``: none unless it is a Hugging Face model.

    Example:
        >>> cache_off(nn.Linear(1, 1))
        CacheOff(hugging_face=False, signature=None)
    """
    if not _is_hugging_face(module):
        return CacheOff()
    forward: Callable[..., Any] = module.forward
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        signature = None
    if signature is not None and "use_cache" not in signature.parameters:
        signature = None
    return CacheOff(hugging_face=True, signature=signature)


# -- helpers ----------------------------------------------------------------------------


def _flag_on(m: nn.Module) -> bool:
    value = getattr(m, _FLAG, False)
    return isinstance(value, (bool, int)) and bool(value)


def _is_hugging_face(module: nn.Module) -> bool:
    """A class of transformers in the MRO (``PreTrainedModel``, also for remote code)."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(module).__mro__)


def _is_checkpointing_layer(m: nn.Module) -> bool:
    """A ``GradientCheckpointingLayer`` (newer transformers): it checkpoints its own forward."""
    return any(
        c.__name__ == "GradientCheckpointingLayer" and c.__module__.startswith("transformers")
        for c in type(m).__mro__
    )


def _layers(path: str, m: nn.Module) -> list[tuple[str, nn.Module]]:
    """The entries of the outermost ``ModuleList``s under ``m``, at any depth: the layers a stack runs.

    A flagged model (``BertModel``) may hold its stack a level down (``encoder.layer``).
    """
    prefix = f"{path}/" if path else ""
    out: list[tuple[str, nn.Module]] = []
    for name, child in m.named_children():
        if isinstance(child, nn.ModuleList):
            out += [(f"{prefix}{name}/{i}", layer) for i, layer in enumerate(child)]
        else:
            out += _layers(f"{prefix}{name}", child)
    return out


def _uncovered(
    flagged: Sequence[tuple[str, nn.Module]], unit_paths: Sequence[str]
) -> list[tuple[str, nn.Module]]:
    """The checkpointed modules whose recompute no unit's remat would replace.

    One inside a unit is covered: the unit's remat recomputes it. A layer that
    checkpoints itself outside every unit is not. A stack (older transformers
    checkpoint each of its layers) outside every unit is covered if each layer it
    runs is a unit; one whose layers checkpoint themselves only turns caches off,
    and its layers are judged by themselves.
    """
    units = tuple(unit_paths)

    def inside(path: str) -> bool:
        return any(path == u or path.startswith(f"{u}/") for u in units)

    out: list[tuple[str, nn.Module]] = []
    for path, m in flagged:
        if inside(path):
            continue
        if _is_checkpointing_layer(m):
            out.append((path, m))
            continue
        layers = _layers(path, m)
        if any(_is_checkpointing_layer(layer) for _, layer in layers):
            continue
        if not layers or not all(inside(p) for p, _ in layers):
            out.append((path, m))
    return out


def _recomputes(remat: bool) -> bool:
    """Whether a unit's forward will run again in backward: remat, in a step, with grad."""
    return remat and current_run() is not None and torch.is_grad_enabled()


def _where(module: nn.Module, at: Sequence[tuple[str, nn.Module]]) -> str:
    names = [path or f"<{type(module).__name__}>" for path, _ in at]
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _refusal(what: str, module: nn.Module, uncovered: Sequence[tuple[str, nn.Module]]) -> str:
    path, m = uncovered[0]
    layers = _layers(path, m)
    example = type(layers[0][1] if layers and not _is_checkpointing_layer(m) else m).__name__
    return (
        f"{what}: Hugging Face gradient checkpointing is on in {_where(module, uncovered)} "
        f"of {type(module).__name__}, outside every unit: HF's recompute in backward would read "
        f"the module's own weights, not the params, and the gradients would be wrong. "
        f"Make the checkpointed layers units and let funcshard recompute them "
        f"(functionalize(model, units=[{example!r}], remat=True)), or call "
        f"model.gradient_checkpointing_disable(){_NEWER}"
        + (" before functionalize" if what == "functionalize" else "")
    )
