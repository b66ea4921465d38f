"""Range checks of single config values: each failure names the key, its bound and the value given."""

from __future__ import annotations

from collections.abc import Mapping

from eaglet.errors import ConfigError

# An unset optional value (null) passes every bound: null means "derive it" wherever the schema allows it.
Values = Mapping[str, float | None]


def _key(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def at_least(section: str, values: Values, minimum: float, hint: str = "") -> None:
    """Each `section.key` >= minimum."""
    for key, value in values.items():
        if value is not None and not value >= minimum:
            raise ConfigError(f"{_key(section, key)} must be >= {minimum}, got {value}{hint}")


def positive(section: str, values: Values, hint: str = "") -> None:
    """Each `section.key` > 0."""
    for key, value in values.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{_key(section, key)} must be > 0, got {value}{hint}")


def within(section: str, values: Values, interval: str, hint: str = "") -> None:
    """Each `section.key` in `interval`, written as in the message: "[0, 1)", "(0, 1]"."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    for key, value in values.items():
        if value is None:
            continue
        above_low = value >= low if interval[0] == "[" else value > low
        below_high = value <= high if interval[-1] == "]" else value < high
        if not (above_low and below_high):
            raise ConfigError(f"{_key(section, key)} must be in {interval}, got {value}{hint}")
