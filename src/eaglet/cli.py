"""What every entry point shares: clean errors for the user, and the config as a typed object."""

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
