"""Interop: any ``nn.Module`` as a pure function over its params, and params and specs with JAX.

``functionalize`` needs only torch; ``to_jax`` / ``from_jax`` import JAX when called
(``pip install 'funcshard[jax]'``) and ``load_orbax`` / ``save_orbax`` TensorStore (``'funcshard[orbax]'``);
``load_safetensors`` (and ``Apply.load_pretrained`` / ``save_pretrained``) need ``safetensors``.
"""

from funcshard._src.interop.apply import Apply as Apply
from funcshard._src.interop.jax import from_jax as from_jax
from funcshard._src.interop.jax import to_jax as to_jax
from funcshard._src.interop.module import functionalize as functionalize
from funcshard._src.interop.orbax import load_orbax as load_orbax
from funcshard._src.interop.orbax_save import save_orbax as save_orbax
from funcshard._src.interop.placeholders import UnboundParameterError as UnboundParameterError
from funcshard._src.interop.safetensors_io import load_safetensors as load_safetensors
from funcshard._src.interop.state_hooks import StateDictHookError as StateDictHookError

__all__ = [
    "Apply",
    "StateDictHookError",
    "UnboundParameterError",
    "from_jax",
    "functionalize",
    "load_orbax",
    "load_safetensors",
    "save_orbax",
    "to_jax",
]
