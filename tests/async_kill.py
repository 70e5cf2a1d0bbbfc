"""``python -m tests.async_kill DIR POINT``: save, then stop an asynchronous save in the middle of its write.

Saves ``DIR/step-1``, then starts an asynchronous save of ``DIR/step-2`` whose
background thread, after ``POINT`` (``write_chunks``: this rank's data files;
``write_manifest``: the manifest, before the rename), prints ``writing`` and waits
forever; the main thread waits too. ``tests/test_async_save.py`` SIGKILLs it there.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch

import funcshard as fs
import funcshard._src.checkpoint.save as saving


def main(directory: str, point: str) -> None:
    fs.checkpoint.save(f"{directory}/step-1", {"w": torch.arange(4.0)}, step=1, run="killed")
    original = getattr(saving, point)
    never = threading.Event()

    def then_stop(*a: Any, **kw: Any) -> Any:
        out = original(*a, **kw)
        print("writing", flush=True)
        never.wait()
        return out

    setattr(saving, point, then_stop)
    saver = fs.checkpoint.AsyncCheckpointer()
    saver.save(f"{directory}/step-2", {"w": torch.ones(4)}, step=2, keep=1, run="killed")
    never.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
