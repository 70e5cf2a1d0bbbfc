"""Host memory per node: what a run keeps in host RAM while it trains, saves and loads, beside DeepSpeed's estimate.

[Note: host memory]
funcshard builds and loads parameters on the device (``fs.materialize``; a checkpoint or a
sharded safetensors file is read chunk by chunk into this rank's shards), so the host
holds, per rank:

- training: nothing of the model, unless checkpoints are saved with
  ``fs.checkpoint.AsyncCheckpointer``, whose pinned staging buffers keep a copy of the
  rank's params, frozen params and optimizer state between saves
  (``Estimate.checkpoint_staging``, ``CostModel(async_checkpoint=True)``);
- saving (``fs.checkpoint.save``): the chunks it writes, copied to the host
  (``save.py: _local_chunks``): at most its params, frozen params and optimizer state;
- loading (``fs.checkpoint.load``): the saved chunks that overlap its shards
  (``load.py: _load_into``): the same bytes when the plan is the one that saved, more
  when a checkpoint is resharded (a chunk read whole though only part of it is needed).

A node's figure is that times the ranks on one node: the hardware's
``devices_per_node`` (8 without ``--hardware``), at most the mesh's size. Not counted:
each process's own runtime (the interpreter, torch and CUDA's libraries, a few GiB) and
the data loader.

DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (``deepspeed/runtime/zero/stage3.py``)
gives, without offload, host bytes per node of
``4 * largest_layer_params * gpus_per_node * 1.5`` with ``zero_init`` (each process
builds one layer at a time) and ``4 * total_params * gpus_per_node * 1.5`` without (each
process builds the whole fp32 model on the host before it is partitioned), 1.5 being its
``additional_buffer_factor``.
"""

from __future__ import annotations

from typing import Any

from funcshard._src.plan.estimates import Memory
from funcshard._src.plan.hardware import Hardware
from funcshard._src.plan.sizes import format_bytes

DEFAULT_RANKS_PER_NODE = 8  # a DGX node, when no --hardware says otherwise
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor default


def ranks_per_node(mesh_size: int, hardware: Hardware | None, /) -> int:
    """The ranks of one node: ``devices_per_node`` (8 without hardware), at most the mesh's size.

    Example:
        >>> ranks_per_node(64, None), ranks_per_node(4, None)
        (8, 4)
    """
    per_node = hardware.devices_per_node if hardware is not None else DEFAULT_RANKS_PER_NODE
    return min(per_node, mesh_size)


def host_per_node(memory: Memory, ranks: int, /, *, async_checkpoint: bool) -> dict[str, int]:
    """Host bytes of one node of ``ranks`` ranks: ``train`` and ``checkpoint`` (save or load).

    See [Note: host memory].

    Example:
        >>> m = Memory(params=10, grads=10, optimizer=20, mixed_precision=0, gathered=5,
        ...     activations=7)
        >>> host_per_node(m, 8, async_checkpoint=False), host_per_node(m, 8, async_checkpoint=True)
        ({'train': 0, 'checkpoint': 240}, {'train': 240, 'checkpoint': 240})
    """
    state = memory.params + memory.frozen + memory.optimizer
    return {"train": ranks * state if async_checkpoint else 0, "checkpoint": ranks * state}


def deepspeed_host(total: int, largest: int, gpus_per_node: int, /) -> dict[str, int]:
    """DeepSpeed's ZeRO-3 host bytes per node without offload, with and without ``zero_init``.

    See [Note: host memory].

    Example:
        >>> deepspeed_host(6_738_415_616, 131_072_000, 8)["zero_init=0"] / 2**30  # LLaMA-7B
        301.2...
    """
    factor = 4 * gpus_per_node * BUFFER_FACTOR
    return {"zero_init=1": int(largest * factor), "zero_init=0": int(total * factor)}


def describe_deepspeed(host: dict[str, Any], gpus_per_node: int, /) -> str:
    """The DeepSpeed figures as one report line."""
    return (
        f"DeepSpeed's ZeRO-3 estimator, host RAM per node of {gpus_per_node} GPUs (no offload, "
        f"additional_buffer_factor 1.5): {format_bytes(host['zero_init=1'])} with zero_init "
        f"(4*largest*GPUs*1.5), {format_bytes(host['zero_init=0'])} without (4*P*GPUs*1.5: "
        f"every process builds the fp32 model on the host)"
    )
