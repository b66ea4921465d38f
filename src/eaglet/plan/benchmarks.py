"""Read the measured tables of experiments/BENCHMARKS.md, so calibration and checks never retype a number.

Layout: `## <machine group>` sections; under each, `### <title> — `<command>` (<note>)` headings, each
followed by optional prose (a date and machine line, say) and one or more markdown tables, separated by blank
lines. Each table becomes one BenchTable carrying its heading and the prose above it; a column name used twice
in one header gets " (2)" appended the second time.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.errors import DataError

_HEADING = re.compile(r"^###\s+(?P<title>.+?)\s+—\s+`(?P<command>[^`]+)`\s*(?:\((?P<note>.*)\))?\s*$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class BenchTable:
    section: str  # the `##` heading above it
    title: str
    command: str
    note: str
    text: str = ""  # the prose between the heading and the table
    columns: list[str] = field(default_factory=list)
    rows: list[dict[str, str]] = field(default_factory=list)

    def args(self) -> dict[str, str]:
        """key=value arguments of the command (after the script), and VAR=value environment prefixes."""
        return dict(token.split("=", 1) for token in shlex.split(self.command) if "=" in token)

    def argv(self) -> list[str]:
        """The arguments after the script: `A=1 python x.py --k v` -> ['--k', 'v']."""
        tokens = shlex.split(self.command)
        while tokens and _ENV.match(tokens[0]):
            tokens.pop(0)
        if tokens and Path(tokens[0]).name.startswith("python"):
            tokens.pop(0)
        return tokens[1:]

    def has_columns(self, *names: str) -> bool:
        return set(names) <= set(self.columns)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return out


def parse_benchmarks(path: str | Path) -> list[BenchTable]:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    tables: list[BenchTable] = []
    section, heading, prose, current = "", None, [], None
    for number, line in enumerate(lines, start=1):
        if line.startswith("## "):
            section, heading, current = line[3:].strip(), None, None
        elif line.startswith("### "):
            heading, prose, current = _HEADING.match(line), [], None
        elif heading is None:
            continue
        elif line.startswith("|"):
            cells = _cells(line)
            if current is None:
                current = BenchTable(
                    section,
                    heading["title"],
                    heading["command"],
                    heading["note"] or "",
                    text=" ".join(prose),
                    columns=_unique(cells),
                )
                tables.append(current)
            elif set("".join(cells)) <= set("-: "):
                continue  # the separator row
            elif len(cells) != len(current.columns):
                raise DataError(
                    f"{path}:{number}: a row of {len(cells)} cells under a header of {len(current.columns)}"
                )
            else:
                current.rows.append(dict(zip(current.columns, cells, strict=True)))
        else:
            current = None  # a blank or prose line ends a table; the next one starts a new table
            if line.strip():
                prose.append(line.strip())
    return [table for table in tables if table.rows]


def number(cell: str) -> float:
    """A measured cell as a float: '37,559' -> 37559.0, '34%' -> 0.34."""
    text = cell.replace(",", "").strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise DataError(f"benchmark cell {cell!r} is not a number") from None
