"""The entry points: one Hydra app per stage, installed as commands and called by the root scripts.

    eaglet-extract ...    (python extract.py ...)      eaglet-train ...      (python train.py ...)
    eaglet-evaluate ...   (python evaluate.py ...)     eaglet-export ...     (python export.py ...)
    eaglet-plan ...       (python plan.py ...)

Each lives in its own module (eaglet.cli.train, ...), whose name is Hydra's job name (outputs/train/<time>).
A module imports Hydra and the config package only; torch, Lightning and the stages are imported inside
`main`, after Hydra has composed, so `--help` and `--cfg job` answer without loading them. This module
holds what they share: clean errors for the user.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from eaglet.errors import EagletError

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Print an EagletError as one message (no traceback) and exit with status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except EagletError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]
