"""State-dict hooks that compute on a module's tensors: found on the meta device, run on live ones.

[Note: state-dict hooks]
A module's ``state_dict`` may run hooks (``register_state_dict_post_hook``,
``_register_state_dict_hook``) and its ``load_state_dict`` hooks of its own
(``register_load_state_dict_pre_hook`` and ``..._post_hook``). Some only rename
keys (``checkpoint_wrapper`` strips its prefix); others compute new tensors from
the parameters (torchtitan's ``FusedQKVLinear`` splits ``wqkv`` into
``wq``/``wk``/``wv`` on save and concatenates them again on load). A
functionalized module holds placeholders, so such a hook must run where values
are bound, and funcshard must know which keys it makes without reading values:

1. **Probe.** :func:`probe` binds a ``meta`` tensor of the right shape and dtype
   to every parameter and buffer name and runs ``module.state_dict(keep_vars=True)``.
   A key whose value is one of the bound tensors holds that tensor (renamed or
   not). A key whose value is a new tensor was computed by a hook; the innermost
   module whose ``state_dict`` call produced it is its :class:`Scope`. Nothing is
   read, nothing is gathered, and the result depends only on the module.
2. **Live, one scope at a time.** :func:`scope_state` binds full values to one
   scope's names and runs that submodule's own ``state_dict`` (its hooks see the
   live, gathered tensors, never a placeholder); :func:`scope_load` runs its
   ``load_state_dict`` on fresh full tensors, so its load hooks compute the
   parameters from the checkpoint's keys. Callers gather one scope's leaves at a
   time (``fs.checkpoint.save_dcp``/``load_dcp``), or already hold them all
   (``apply.state_dict``).
3. **Errors name the hook.** A hook outside torch and funcshard that raises in the
   probe or in a live run raises :class:`StateDictHookError`, naming the module
   path, the hook's kind and name, and a fix; a hook of torch's own (where no frame
   outside torch and funcshard is found) raises its own error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from funcshard._src.interop.binding import swapped

__all__ = [
    "Scope",
    "StateDictHookError",
    "StateLayout",
    "named_tensors",
    "probe",
    "run_state_dict",
    "scope_load",
    "scope_state",
]

_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class StateDictHookError(RuntimeError):
    """A module's state-dict hook raised where funcshard ran it; the message names the hook.

    Example:
        >>> issubclass(StateDictHookError, RuntimeError)
        True
    """


@dataclasses.dataclass(frozen=True, eq=False)
class Scope:
    """A submodule whose state-dict hook computes entries from its tensors."""

    path: str  # dotted module path ("" for the root)
    prefix: str  # the prefix its state_dict ran under in the module's state_dict
    module: nn.Module
    hooks: str  # how messages name its hooks
    keys: tuple[tuple[str, str], ...]  # (key its own state_dict gives, key in the module's)
    computed: frozenset[str]  # the module's keys a hook made (not a bound tensor)
    names: tuple[str, ...]  # the dotted tensor names under it (parameters and buffers)

    def local(self, name: str, /) -> str:
        """``name`` relative to the scope's module."""
        return name[len(self.path) + 1 :] if self.path else name


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What ``module.state_dict()`` holds, learned on the meta device ([Note: state-dict hooks])."""

    keys: tuple[str, ...]  # every key, in order
    of_key: Mapping[str, str]  # key -> the dotted tensor name it holds (a bound tensor)
    scopes: tuple[Scope, ...]
    other: tuple[str, ...]  # keys holding neither (extra state, a non-tensor)
    metas: Mapping[str, torch.Tensor]  # every tensor key -> its value on the meta device

    def scope_of(self, key: str, /) -> Scope | None:
        """The scope that computed ``key``, if a hook did."""
        return next((s for s in self.scopes if key in s.computed), None)


def probe(module: nn.Module, like: Mapping[str, torch.Tensor], /) -> StateLayout:
    """The keys of ``module.state_dict()`` and what each holds, computed on the meta device.

    Args:
        module: the module (it may hold placeholders).
        like: every dotted name of a parameter or buffer -> a tensor of its shape and
            dtype (names of one tensor share one object).

    Raises:
        StateDictHookError: a hook raised on shapes alone (the message names it).

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> layout = probe(lin, dict(lin.named_parameters()))
        >>> layout.keys, dict(layout.of_key), layout.scopes
        (('weight', 'bias'), {'weight': 'weight', 'bias': 'bias'}, ())
    """
    metas: dict[int, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in like.items():
        meta = metas.get(id(t))
        if meta is None:
            meta = metas[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="meta")
        tensors[name] = meta
    name_of: dict[int, str] = {}
    for name, meta in tensors.items():
        name_of.setdefault(id(meta), name)
    found: list[tuple[str, nn.Module, str, OrderedDict[str, Any]]] = []
    made: dict[int, int] = {}  # id of a computed tensor -> index into found
    keep: list[Any] = []  # keeps every produced tensor alive, so no id is reused

    def record(path: str, mod: nn.Module, prefix: str, new: OrderedDict[str, Any]) -> None:
        computed = [v for v in new.values() if isinstance(v, torch.Tensor) and id(v) not in name_of]
        fresh = [v for v in computed if id(v) not in made]
        if fresh:
            found.append((path, mod, prefix, new))
            for v in fresh:
                made[id(v)] = len(found) - 1
        keep.append(new)

    with swapped(module, tensors), _watching(module, record):
        state = _call_state_dict(module, "", module, keep_vars=True)
    of_key: dict[str, str] = {}
    other: list[str] = []
    computed: dict[int, set[str]] = {}
    final_of: dict[int, str] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and id(value) in name_of:
            of_key[key] = name_of[id(value)]
        elif isinstance(value, torch.Tensor) and id(value) in made:
            computed.setdefault(made[id(value)], set()).add(key)
        else:
            other.append(key)
        if isinstance(value, torch.Tensor):
            final_of.setdefault(id(value), key)
    scopes = []
    for i, (path, mod, prefix, new) in enumerate(found):
        if i not in computed:
            continue  # what it made, an outer hook dropped
        pairs = tuple(
            (local, final_of[id(v)])
            for local, v in new.items()
            if isinstance(v, torch.Tensor) and id(v) in final_of
        )
        under = tuple(n for n in like if not path or n.startswith(path + "."))
        scopes.append(
            Scope(path, prefix, mod, _hook_names(mod), pairs, frozenset(computed[i]), under)
        )
    on_meta = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return StateLayout(tuple(state), of_key, tuple(scopes), tuple(other), on_meta)


def scope_state(scope: Scope, values: Mapping[str, torch.Tensor], /) -> dict[str, torch.Tensor]:
    """The keys ``scope``'s hooks compute, from full ``values`` of its names (dotted, as the module's).

    Runs the scope module's own ``state_dict`` with the values bound; returns the
    computed keys (named as in the module's ``state_dict``), detached.

    Raises:
        StateDictHookError: a hook raised (the message names it).
    """
    tensors = {scope.local(n): v for n, v in values.items() if n in scope.names}
    with swapped(scope.module, tensors):
        out = _call_state_dict(scope.module, scope.path, scope.module, prefix=scope.prefix)
    by_local = dict(scope.keys)
    return {
        by_local[k]: v.detach()
        for k, v in out.items()
        if k in by_local and by_local[k] in scope.computed
    }


def scope_load(
    scope: Scope,
    entries: Mapping[str, torch.Tensor],
    like: Mapping[str, torch.Tensor],
    /,
) -> dict[str, torch.Tensor]:
    """Full values of ``scope``'s names, loaded by its module's ``load_state_dict`` from ``entries``.

    ``entries`` hold every key of the module's ``state_dict`` that the scope gave
    (computed or not); ``like`` gives each name's shape and dtype. The module's
    load hooks run on fresh full tensors bound to its names.

    Raises:
        StateDictHookError: a hook raised, or the scope's keys did not load
            (the message names the module and its hooks).
    """
    fresh: dict[int, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name in scope.names:
        t = like[name]
        if id(t) not in fresh:
            fresh[id(t)] = torch.zeros(t.shape, dtype=t.dtype)
        tensors[scope.local(name)] = fresh[id(t)]
    final_to_local = {final: local for local, final in scope.keys}
    given = {
        final_to_local[k][len(scope.prefix) :]: v for k, v in entries.items() if k in final_to_local
    }
    bound = dict(tensors)
    with swapped(scope.module, bound), _hook_errors(scope.path, scope.module, "load"):
        result = scope.module.load_state_dict(given, strict=False)
    missing = list(result.missing_keys)
    if missing or result.unexpected_keys:
        raise StateDictHookError(
            f"{scope.path or '<root>'}: {type(scope.module).__name__}.load_state_dict did not "
            f"load what its state_dict gave (missing {missing}, unexpected "
            f"{list(result.unexpected_keys)}); its load hooks ({scope.hooks}) do not invert its "
            f"state-dict hooks. Fix: make the load pre-hook turn the saved keys back into the "
            f"module's parameters"
        )
    return {name: tensors[scope.local(name)] for name in scope.names}


def named_tensors(module: nn.Module, /) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by dotted name, each (module, attribute) once.

    A submodule reached by two paths is listed under the first (torch's
    ``state_dict`` gives both; they hold one tensor).

    Example:
        >>> list(named_tensors(nn.BatchNorm1d(2)))
        ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    seen: set[tuple[int, str]] = set()
    out: dict[str, torch.Tensor] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for attr, t in (*m._parameters.items(), *m._buffers.items()):
            if t is None or (id(m), attr) in seen:
                continue
            seen.add((id(m), attr))
            out[f"{path}.{attr}" if path else attr] = t
    return out


def run_state_dict(module: nn.Module, /) -> dict[str, Any]:
    """``module.state_dict(keep_vars=True)``; a hook that raises is named ([Note: state-dict hooks]).

    Raises:
        StateDictHookError: a state-dict hook raised.

    Example:
        >>> list(run_state_dict(nn.Linear(1, 1)))
        ['weight', 'bias']
    """
    return _call_state_dict(module, "", module, keep_vars=True)


# -- running and watching hooks -------------------------------------------------------


def _call_state_dict(
    module: nn.Module, path: str, owner: nn.Module, *, prefix: str = "", keep_vars: bool = True
) -> dict[str, Any]:
    with _hook_errors(path, owner, "save"):
        return module.state_dict(prefix=prefix, keep_vars=keep_vars)


@contextlib.contextmanager
def _hook_errors(path: str, module: nn.Module, kind: str) -> Iterator[None]:
    """Re-raises what a hook raised as :class:`StateDictHookError`, naming the hook."""
    try:
        yield
    except StateDictHookError:
        raise
    except Exception as e:
        where, hook = _failing_hook(e)
        where = where if where is not None else (path or "<root>")
        if hook is None:
            raise
        meta = "meta" in str(e)
        fix = (
            "make the hook work on shapes alone (no .item(), .tolist() or data-dependent "
            "branches): funcshard runs it on the meta device to learn the keys it makes"
            if meta
            else "fix the hook, or save the module with apply.state_dict(fs.unshard(sparams)) "
            "and torch.save"
        )
        what = "state-dict hook" if kind == "save" else "load-state-dict hook"
        raise StateDictHookError(
            f"{where}: the {what} {hook} raised {type(e).__name__}: {e}\nFix: {fix}"
        ) from e


def _failing_hook(error: BaseException) -> tuple[str | None, str | None]:
    """(module prefix, hook name) of the innermost hook in ``error``'s traceback, if any."""
    tb = error.__traceback__
    prefix: str | None = None
    hook: str | None = None
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_name in ("state_dict", "_load_from_state_dict", "load") and isinstance(
            frame.f_locals.get("self", frame.f_locals.get("module")), nn.Module
        ):
            p = frame.f_locals.get("prefix")
            if isinstance(p, str):
                prefix = p.rstrip(".") or "<root>"
            hook = None
        elif prefix is not None and hook is None and not _ours_or_torch(code.co_filename):
            hook = getattr(code, "co_qualname", code.co_name)  # 3.11+: Class.function
        tb = tb.tb_next
    return prefix, hook


def _ours_or_torch(filename: str) -> bool:
    return os.path.abspath(filename).startswith((_HERE, _TORCH)) or filename.startswith("<frozen")


def _hook_names(module: nn.Module) -> str:
    hooks = [*module._state_dict_hooks.values(), *module._load_state_dict_pre_hooks.values()]
    names = [getattr(getattr(h, "hook", h), "__qualname__", repr(h)) for h in hooks]
    return ", ".join(names) or "none"


@contextlib.contextmanager
def _watching(
    module: nn.Module, record: Callable[[str, nn.Module, str, OrderedDict[str, Any]], None]
) -> Iterator[None]:
    """Wraps the ``state_dict`` of every submodule with state-dict hooks; mutates them.

    torch's ``state_dict`` calls each child's ``state_dict`` method, so an instance
    attribute sees each call; ``record`` gets the keys the call added or changed.
    """
    wrapped: list[nn.Module] = []

    def wrap(path: str, mod: nn.Module) -> None:
        original = mod.state_dict

        def state_dict(*args: Any, **kwargs: Any) -> Any:
            destination = kwargs.get("destination")
            prefix = kwargs.get("prefix", "")
            before = (
                {k: id(v) for k, v in destination.items() if k.startswith(prefix)}
                if destination is not None
                else {}
            )
            out = original(*args, **kwargs)
            new = OrderedDict(
                (k, v) for k, v in out.items() if k.startswith(prefix) and before.get(k) != id(v)
            )
            record(path, mod, prefix, new)
            return out

        vars(mod)["state_dict"] = state_dict
        wrapped.append(mod)

    try:
        for path, mod in module.named_modules():
            if mod._state_dict_hooks:
                wrap(path, mod)
        yield
    finally:
        for mod in wrapped:
            vars(mod).pop("state_dict", None)
