"""Forge a checkpoint file that passes the manifest's checksum: for tests of untrusted content.

A checksum proves only that a file is what the writer listed, not that the writer was dpscale or
that the content makes sense; tests use this to hand the loader valid-looking nonsense.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def replace_checkpoint_file(step_dir: Path, name: str, obj: object) -> Path:
    """Write `obj` as `step_dir/name` and update the manifest's size and SHA-256 to match."""
    path = Path(step_dir) / name
    torch.save(obj, path)
    manifest_path = Path(step_dir) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["size_bytes"] = path.stat().st_size
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    return path
