"""Readers for request traces: Azure LLM inference CSV, BurstGPT CSV, Mooncake JSONL and
length-only CSV, each plain or gzip-compressed (told by the file's first bytes, not its name).

Any file of these formats reads, not just the bundled ones, so a reader checks every line and a
bad one fails the whole read with the file and line in the message: a silently skipped row would
change the workload a result was measured on.
"""
from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

FORMATS = ("azure", "burstgpt", "mooncake", "lengths")
MOONCAKE_HASH_BLOCK_TOKENS = 512  # Mooncake traces hash prompts in 512-token prefix blocks

_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
_LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
# BurstGPT (HPMLL/BurstGPT): Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,
# the timestamp in seconds from the trace's start; a failed request has 0 response tokens
_BURSTGPT_COLUMNS = ("timestamp", "request tokens", "response tokens")
# Azure writes 7 fractional digits, which datetime.fromisoformat rejects before Python 3.11.
_TIMESTAMP = re.compile(
    r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d+))?(Z|[+-]\d\d:?\d\d)?"
)


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, the 1-based line and the fault."""

    def __init__(self, path: str | os.PathLike, problem: str, line: int | None = None) -> None:
        self.path, self.line, self.problem = Path(path), line, problem
        where = str(path) if line is None else f"{path}:{line}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class TraceRecord:
    """One row of a trace. ``arrival_s`` is seconds in the trace's own time, None if it has none."""

    arrival_s: float | None
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class Trace:
    """The records of one trace file, in file order."""

    records: tuple[TraceRecord, ...]
    format: str  # one of FORMATS
    path: Path
    hash_block_tokens: int | None = None  # prompt tokens per hash id, where records have hashes

    @property
    def has_arrivals(self) -> bool:
        return self.format != "lengths"

    @property
    def last_arrival_s(self) -> float:
        """The last record's arrival, in the trace's own seconds (a trace with arrival times)."""
        return max(r.arrival_s for r in self.records)

    def __len__(self) -> int:
        return len(self.records)


def bundled_trace(name: str) -> Path:
    """A trace file shipped with the package (see env/workloads/data/README.md)."""
    return Path(__file__).resolve().parent / "data" / name


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a trace, telling its format from the header (CSV) or first line (JSONL)."""
    path = Path(path)
    lines = _read_lines(path)
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]  # blank lines hold no row
    if not numbered:
        raise TraceError(path, "empty file")
    number, first = numbered[0]
    if first.lstrip().startswith("{"):
        records = tuple(_mooncake_record(path, n, line) for n, line in numbered)
        return Trace(records, "mooncake", path, MOONCAKE_HASH_BLOCK_TOKENS)
    (number, header), *rows = _csv_rows(path, lines)
    columns = set(c.lower() for c in header)
    if set(_AZURE_COLUMNS) <= columns:
        kind = "azure"
    elif set(_BURSTGPT_COLUMNS) <= columns:
        kind = "burstgpt"
    elif set(_LENGTH_COLUMNS) <= columns:
        kind = "lengths"
    else:
        raise TraceError(
            path,
            f"unknown trace format: header {first.strip()!r} has neither the Azure columns "
            f"({','.join(_AZURE_COLUMNS)}), nor BurstGPT's ({','.join(_BURSTGPT_COLUMNS)}), nor the "
            f"length-only ones ({','.join(_LENGTH_COLUMNS)}), and the line is not a Mooncake JSON object",
            number,
        )
    if not rows:
        raise TraceError(path, "header but no records", number)
    if kind == "azure":
        return Trace(_timed_records(path, header, rows, _AZURE_COLUMNS, _timestamp), kind, path)
    if kind == "burstgpt":
        return Trace(_timed_records(path, header, rows, _BURSTGPT_COLUMNS, _seconds), kind, path)
    at = [[c.lower() for c in header].index(c) for c in _LENGTH_COLUMNS]
    records = tuple(
        TraceRecord(None, *_counts(path, n, _fields(path, n, fields, header), header, at))
        for n, fields in rows
    )
    return Trace(records, kind, path)


def _read_lines(path: Path) -> list[str]:
    """The file's lines, line ends kept (the CSV reader needs them inside quoted fields)."""
    try:
        with open(path, "rb") as f:
            packed = f.read(2) == b"\x1f\x8b"  # gzip's magic number
        opener = gzip.open if packed else open
        with opener(path, "rt", encoding="utf-8-sig", newline="") as f:  # -sig: a spreadsheet's byte-order mark
            return f.readlines()
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, not a trace file") from None
    except UnicodeDecodeError as e:
        where = "once decompressed " if packed else ""
        raise TraceError(path, f"not UTF-8 text {where}({e.reason} at byte {e.start})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # a damaged or cut-short archive
        raise TraceError(path, f"a gzip file that does not decompress ({e or type(e).__name__})") from None


def _csv_rows(path: Path, lines: list[str]) -> list[tuple[int, list[str]]]:
    """The non-blank CSV records, fields stripped, each with the 1-based line it starts on. The
    ``csv`` module reads them, so a quoted field may hold commas (or line breaks), as a
    spreadsheet writes them; a broken quote fails the read at its record's line."""
    reader = csv.reader(lines, skipinitialspace=True, strict=True)
    rows, start = [], 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return rows
        except csv.Error as e:
            raise TraceError(path, f"malformed line: {e}", start) from None
        if any(f.strip() for f in fields):
            rows.append((start, [f.strip() for f in fields]))
        start = reader.line_num + 1


def _fields(path: Path, number: int, fields: list[str], header: list[str]) -> list[str]:
    if len(fields) != len(header):
        raise TraceError(
            path, f"malformed line: expected {len(header)} fields, got {len(fields)}", number
        )
    return fields


def _count(path: Path, number: int, name: str, value: object) -> int:
    """A token count: a non-negative integer, as text (CSV) or a JSON number; a whole number written
    with a point (``1000.0``, as a data frame writes a column with a gap) too, in either."""
    if value == "":
        raise TraceError(path, f"missing field {name}: empty value", number)
    if isinstance(value, str) and (whole := re.fullmatch(r"([+-]?[0-9]+)(?:\.0*)?", value)):
        value = int(whole.group(1))
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, f"non-integer token count {name}={value!r}", number)
    if value < 0:
        raise TraceError(path, f"negative token count {name}={value}", number)
    return value


def _counts(
    path: Path, number: int, fields: list[str], header: list[str], at: list[int]
) -> tuple[int, int]:
    """(prompt, output) token counts from the columns at ``at``, named by the file's header."""
    prompt_at, output_at = at
    return (
        _count(path, number, header[prompt_at], fields[prompt_at]),
        _count(path, number, header[output_at], fields[output_at]),
    )


def _timed_records(path: Path, header: list[str], rows: list, columns: tuple[str, str, str],
                   stamp) -> tuple[TraceRecord, ...]:
    """Rows with a time, a prompt and an output column (``columns``, by name); arrivals are seconds
    after the earliest row (the first, in a sorted trace). ``stamp`` reads a time as (whole
    seconds, fraction): as one float since year 1, Azure's 7th digit would be lost."""
    names = [c.lower() for c in header]
    at_time, *at_counts = (names.index(c) for c in columns)
    stamps, lengths = [], []
    for number, fields in rows:
        fields = _fields(path, number, fields, header)
        stamps.append(stamp(path, number, fields[at_time]))
        lengths.append(_counts(path, number, fields, header, at_counts))
    whole0, frac0 = min(stamps)
    return tuple(
        TraceRecord((whole - whole0) + (frac - frac0), prompt, output)
        for (whole, frac), (prompt, output) in zip(stamps, lengths)
    )


def _seconds(path: Path, number: int, text: str) -> tuple[int, float]:
    """BurstGPT's time: seconds from the trace's start, as (0, seconds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise TraceError(path, f"bad timestamp {text!r}: not a number of seconds >= 0", number)
    return 0, value


def _timestamp(path: Path, number: int, text: str) -> tuple[int, float]:
    """(whole UTC seconds since 0001-01-01, fraction of a second) of an ISO-like timestamp."""
    match = _TIMESTAMP.fullmatch(text)
    try:
        if match is None:
            raise ValueError
        year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
        day_number = datetime(year, month, day, hour, minute, second).toordinal()
    except ValueError:
        raise TraceError(path, f"bad timestamp {text!r}", number) from None
    digits, zone = match.group(7) or "0", match.group(8) or "Z"
    offset = 0
    if zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        offset = sign * (int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
    whole = day_number * 86400 + hour * 3600 + minute * 60 + second - offset
    return whole, int(digits) / 10 ** len(digits)


def _mooncake_record(path: Path, number: int, line: str) -> TraceRecord:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(path, f"malformed line: not JSON ({e.msg})", number) from None
    if not isinstance(row, dict):
        raise TraceError(path, "malformed line: not a JSON object", number)
    for key in ("timestamp", "input_length", "output_length"):
        if key not in row:
            raise TraceError(path, f"missing field {key!r}", number)
    stamp = row["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
        raise TraceError(path, f"bad timestamp {stamp!r}: not a number of milliseconds", number)
    if stamp < 0:
        raise TraceError(path, f"bad timestamp {stamp!r}: negative", number)
    hashes = row.get("hash_ids", [])
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hashes
    ):
        raise TraceError(path, "bad hash_ids: not a list of integers", number)
    return TraceRecord(
        arrival_s=stamp / 1000.0,
        prompt_len=_count(path, number, "input_length", row["input_length"]),
        output_len=_count(path, number, "output_length", row["output_length"]),
        hash_ids=tuple(hashes),
    )
