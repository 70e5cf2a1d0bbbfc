"""An attacker's tools for checkpoint tests: rewrite a checkpoint's files so that they still look sound.

A damaged file fails its digest; a *crafted* one comes with digests recomputed,
so that only funcshard's checks of the contents stand between it and the
reader. These helpers do what such an attacker would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from funcshard._src.checkpoint import manifest as manifest_module


def read(directory: Path) -> dict[str, Any]:
    """The manifest as JSON data, unchecked."""
    return json.loads((directory / "manifest.json").read_text())


def write(directory: Path, manifest: dict[str, Any], *, fix_digest: bool = True) -> None:
    """Writes ``manifest`` back; with ``fix_digest``, with its self-digest recomputed."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    if fix_digest:
        body["digest"] = manifest_module._digest(body)  # pyright: ignore[reportPrivateUsage]
    elif "digest" in manifest:
        body["digest"] = manifest["digest"]
    (directory / "manifest.json").write_text(json.dumps(body))


def edit(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Applies ``change`` to the manifest in place and writes it back with a valid digest."""
    manifest = read(directory)
    change(manifest)
    write(directory, manifest)


def replace_file(directory: Path, name: str, data: bytes) -> None:
    """Replaces ``rank<r>/<file>`` and fixes its size (and SHA-256) in the manifest."""
    (directory / name).write_bytes(data)

    def fix(manifest: dict[str, Any]) -> None:
        info: dict[str, Any] = {"size": len(data)}
        if name.endswith(".metadata"):
            info["sha256"] = hashlib.sha256(data).hexdigest()
        manifest["files"][name] = info

    edit(directory, fix)
