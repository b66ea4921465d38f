"""The two files of a serving-format folder, both formats alike: config.json beside model.safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eaglet.errors import DataError

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(
            f"{path} does not exist; point at an exported draft folder (config.json + model.safetensors)"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}") from e
    if not isinstance(config, dict):
        raise DataError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config
