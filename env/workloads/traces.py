"""Readers for request traces: Azure LLM inference CSV, BurstGPT CSV, Mooncake and Qwen Bailian JSONL, and
length-only CSV (vidur's and sarathi-serve's processed traces; with their ``arrived_at`` column, arrivals
too), each plain or gzip-compressed (told by the file's first bytes, not its name).

Any file of these formats reads, not just the bundled ones, so a reader checks every line and a
bad one fails the whole read with the file and line in the message: a silently skipped row would
change the workload a result was measured on.
"""
from __future__ import annotations

import csv
import gzip
import itertools
import json
import math
import os
import re
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import numpy as np

FORMATS = ("azure", "burstgpt", "mooncake", "bailian", "vidur", "lengths")
MOONCAKE_HASH_BLOCK_TOKENS = 512  # Mooncake traces hash prompts in 512-token prefix blocks
# Alibaba's Qwen Bailian traces (alibaba-edu/qwen-bailian-usagetraces-anon): Mooncake's fields and a chat's
# own (chat_id, parent_chat_id, turn, type), told by those two; timestamps in seconds, hash ids of 16 tokens
_BAILIAN_KEYS = ("chat_id", "parent_chat_id")
BAILIAN_HASH_BLOCK_TOKENS = 16
# each JSONL format's timestamp unit (its name, how many make a second) and prompt tokens per hash id
_JSONL = {"mooncake": (("milliseconds", 1000.0), MOONCAKE_HASH_BLOCK_TOKENS),
          "bailian": (("seconds", 1.0), BAILIAN_HASH_BLOCK_TOKENS)}
MAX_COUNT = 10**15  # a token count past it is no request's: refused, where it would overflow the columns

_AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")
_LENGTH_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
# vidur's processed traces with arrivals (microsoft/vidur data/processed_traces, e.g. splitwise_conv.csv):
# the length-only columns and the arrival in seconds from the trace's start
_VIDUR_COLUMNS = ("arrived_at", *_LENGTH_COLUMNS)
# BurstGPT (HPMLL/BurstGPT): Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,
# the timestamp in seconds from the trace's start; a failed request has 0 response tokens
_BURSTGPT_COLUMNS = ("timestamp", "request tokens", "response tokens")
# what other compressors' files open with: named in the refusal, where reading them as text would say nothing useful
_NOT_READ = tuple((start, f"{kind} file: traces are read as text or gzip; decompress it first")
                  for kind, start in (("an xz", b"\xfd7zXZ\x00"), ("a bzip2", b"BZh"), ("a zip", b"PK\x03\x04"),
                                      ("a zstd", b"\x28\xb5\x2f\xfd"))) + tuple(
    (start, "UTF-16 text: traces are read as UTF-8 (iconv -f UTF-16 -t UTF-8 converts it)")
    for start in (b"\xff\xfe", b"\xfe\xff"))
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
    """The rows of one trace file, in file order, held as columns: a week of Azure's trace is tens of
    millions of rows, which as one Python object each would not fit a machine's memory.

    ``arrivals`` are seconds after the earliest row (None for a length-only trace), ``prompt_lens``
    and ``output_lens`` token counts, ``hash_ids`` each row's prefix-block hashes where the format
    has them."""

    arrivals: np.ndarray | None  # float64
    prompt_lens: np.ndarray  # int64
    output_lens: np.ndarray  # int64
    format: str  # one of FORMATS
    path: Path
    hash_ids: tuple[tuple[int, ...], ...] | None = None
    hash_block_tokens: int | None = None  # prompt tokens per hash id, where records have hashes

    @property
    def has_arrivals(self) -> bool:
        return self.arrivals is not None

    @property
    def last_arrival_s(self) -> float:
        """The last record's arrival, in the trace's own seconds (a trace with arrival times)."""
        return float(self.arrivals.max())

    @property
    def mean_rate_rps(self) -> float | None:
        """Requests a second of trace time, from the first arrival to the last; None for a trace
        without arrival times, or whose arrivals all come at one time."""
        if self.arrivals is None or self.last_arrival_s <= 0:  # arrivals count from the earliest, at 0
            return None
        return (len(self) - 1) / self.last_arrival_s

    def record(self, row: int) -> TraceRecord:
        """Row ``row`` (0-based, file order) as one record."""
        return TraceRecord(None if self.arrivals is None else float(self.arrivals[row]), int(self.prompt_lens[row]),
                           int(self.output_lens[row]), () if self.hash_ids is None else self.hash_ids[row])

    @property
    def records(self) -> tuple[TraceRecord, ...]:
        """Every row as a record: for reading a small trace; the columns serve a large one."""
        return tuple(self.record(i) for i in range(len(self)))

    def __len__(self) -> int:
        return len(self.prompt_lens)


def bundled_trace(name: str) -> Path:
    """A trace file shipped with the package (see env/workloads/data/README.md)."""
    return Path(__file__).resolve().parent / "data" / name


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a trace, telling its format from the header (CSV) or first line (JSONL). The file is read
    as a stream, row by row, into columns."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        packed = magic[:2] == b"\x1f\x8b"  # gzip's magic number
        for start, what in _NOT_READ:
            if magic.startswith(start):
                raise TraceError(path, what)
        opener = gzip.open if packed else open
        with opener(path, "rt", encoding="utf-8-sig", newline="") as f:  # -sig: a spreadsheet's byte-order mark
            return _read(path, f)
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, "is a directory, not a trace file") from None
    except PermissionError:
        raise TraceError(path, "cannot be read (permission denied)") from None
    except UnicodeDecodeError as e:
        where = "once decompressed " if packed else ""
        raise TraceError(path, f"not UTF-8 text {where}({e.reason} at byte {e.start})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # a damaged or cut-short archive
        raise TraceError(path, f"a gzip file that does not decompress ({e or type(e).__name__})") from None


def _read(path: Path, f) -> Trace:
    """The trace in the open text file ``f``: its format told by its first non-blank line, its rows
    checked and gathered into columns one at a time."""
    skipped = []  # blank lines before the first row, handed on to the reader so that line numbers hold
    for line in f:
        skipped.append(line)
        if line.strip():
            break
    else:
        raise TraceError(path, "empty file")
    number, first = len(skipped), skipped[-1]
    if "\x00" in first:
        raise TraceError(path, "binary data, not a text trace (a tar archive? unpack it first)", number)
    lines = itertools.chain(skipped, f)
    if first.lstrip().startswith("{"):
        return _jsonl(path, ((n, line) for n, line in enumerate(lines, start=1) if line.strip()))
    if first.lstrip().startswith("["):
        raise TraceError(path, "a JSON array: a JSON trace is read as JSONL, one object a line (jq -c '.[]' writes "
                               "an array so)", number)
    rows = _csv_rows(path, lines)
    header = next(rows, (None, None))[1]
    if header is None:
        raise TraceError(path, "no header: every line holds only empty fields")
    columns = set(c.lower() for c in header)
    if set(_AZURE_COLUMNS) <= columns:
        kind, columns, stamp = "azure", _AZURE_COLUMNS, _timestamp
    elif set(_BURSTGPT_COLUMNS) <= columns:
        kind, columns, stamp = "burstgpt", _BURSTGPT_COLUMNS, _seconds
    elif set(_VIDUR_COLUMNS) <= columns:
        kind, columns, stamp = "vidur", _VIDUR_COLUMNS, _seconds
    elif set(_LENGTH_COLUMNS) <= columns:
        kind, columns, stamp = "lengths", (None, *_LENGTH_COLUMNS), None
    else:
        raise TraceError(
            path,
            f"unknown trace format: header {first.strip()!r} has neither the Azure columns "
            f"({','.join(_AZURE_COLUMNS)}), nor BurstGPT's ({','.join(_BURSTGPT_COLUMNS)}), nor the "
            f"length-only ones ({','.join(_LENGTH_COLUMNS)}, with {_VIDUR_COLUMNS[0]} for arrivals), "
            f"and the line is not a Mooncake JSON object"
            + ("; its columns look separated by tabs or semicolons, where CSV traces are read comma-separated"
               if len(header) == 1 and ("\t" in first or ";" in first) else ""),
            number,
        )
    names = [c.lower() for c in header]
    at_time, at_prompt, at_output = (None if c is None else names.index(c) for c in columns)
    whole, frac, prompts, outputs = array("q"), array("d"), array("q"), array("q")
    for n, fields in rows:
        if len(fields) != len(header):
            raise TraceError(path, f"malformed line: expected {len(header)} fields, got {len(fields)}", n)
        if stamp is not None:
            w, x = stamp(path, n, fields[at_time])
            whole.append(w)
            frac.append(x)
        prompts.append(_count(path, n, header[at_prompt], fields[at_prompt]))
        outputs.append(_count(path, n, header[at_output], fields[at_output]))
    if not prompts:
        raise TraceError(path, "header but no records", number)
    arrivals = None
    if stamp is not None:  # seconds after the earliest row: as one float since year 1, Azure's 7th digit would be lost
        whole_s, frac_s = np.frombuffer(whole, dtype=np.int64), np.frombuffer(frac, dtype=np.float64)
        earliest = np.lexsort((frac_s, whole_s))[0]
        arrivals = (whole_s - whole_s[earliest]).astype(np.float64) + (frac_s - frac_s[earliest])
    return Trace(arrivals, np.frombuffer(prompts, dtype=np.int64), np.frombuffer(outputs, dtype=np.int64), kind, path)


def _csv_rows(path: Path, lines) -> Iterator[tuple[int, list[str]]]:
    """The non-blank CSV records, fields stripped, each with the 1-based line it starts on. The
    ``csv`` module reads them, so a quoted field may hold commas (or line breaks), as a
    spreadsheet writes them; a broken quote fails the read at its record's line."""
    reader = csv.reader(lines, skipinitialspace=True, strict=True)
    start = 1
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise TraceError(path, f"malformed line: {e}", start) from None
        if any(f.strip() for f in fields):
            yield start, [f.strip() for f in fields]
        start = reader.line_num + 1


def _count(path: Path, number: int, name: str, value: object) -> int:
    """A token count: a non-negative integer, as text (CSV) or a JSON number; a whole number written
    with a point (``1000.0``, as a data frame writes a column with a gap) too, in either."""
    if type(value) is str and value.isascii() and value.isdigit() and len(value) < 16:  # the common case, first
        return int(value)
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
    if value > MAX_COUNT:
        raise TraceError(path, f"token count {name}={value} is past {MAX_COUNT:,} (no request is that long)", number)
    return value


def _seconds(path: Path, number: int, text: str) -> tuple[int, float]:
    """BurstGPT's ``Timestamp`` and vidur's ``arrived_at``: seconds from the trace's start, as (0, seconds)."""
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
        whole = _whole_seconds(match.group(1, 2, 3, 4, 5, 6, 8))
    except ValueError:
        raise TraceError(path, f"bad timestamp {text!r}: not a date and time such as 2023-11-16 18:17:03.9799600 "
                               f"(a UTC offset such as +00:00 may follow)", number) from None
    digits = match.group(7)
    return whole, 0.0 if digits is None else int(digits) / 10 ** len(digits)


@lru_cache(maxsize=65536)
def _whole_seconds(fields: tuple[str | None, ...]) -> int:
    """UTC seconds since 0001-01-01 of (year, month, day, hour, minute, second, zone) as written (a
    ValueError for a time that does not exist); a trace's rows share their seconds with their neighbours."""
    year, month, day, hour, minute, second = (int(g) for g in fields[:6])
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError
    zone = fields[6] or "Z"
    offset = 0
    if zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        offset = sign * (int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
    return datetime(year, month, day).toordinal() * 86400 + hour * 3600 + minute * 60 + second - offset


def _jsonl(path: Path, numbered: Iterable[tuple[int, str]]) -> Trace:
    """A Mooncake or a Qwen Bailian JSONL trace (the first row's fields tell which); its timestamps
    become seconds after the earliest row, as every format's do (a trace may count from an epoch or
    start late)."""
    stamps, prompts, outputs, hashes, kind = array("d"), array("q"), array("q"), [], None
    for number, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(path, f"malformed line: not JSON ({e.msg}; a JSONL trace holds one object a line)",
                             number) from None
        except (ValueError, RecursionError) as e:  # an integer too long to read, nesting too deep
            raise TraceError(path, f"malformed line: not JSON a trace holds ({e})", number) from None
        if not isinstance(row, dict):
            raise TraceError(path, "malformed line: not a JSON object (a JSONL trace holds one object a line)", number)
        if kind is None:
            kind = "bailian" if all(k in row for k in _BAILIAN_KEYS) else "mooncake"
        stamp, prompt, output, hash_ids = _jsonl_row(path, number, row, kind)
        stamps.append(stamp)
        prompts.append(prompt)
        outputs.append(output)
        hashes.append(hash_ids)
    (_, per_second), block = _JSONL[kind]
    t = np.frombuffer(stamps, dtype=np.float64)
    return Trace((t - t.min()) / per_second, np.frombuffer(prompts, dtype=np.int64),
                 np.frombuffer(outputs, dtype=np.int64), kind, path, tuple(hashes), block)


def _finite(x: int | float) -> bool:
    """Whether ``x`` is a finite number a float can hold (an integer past 1.8e308 cannot)."""
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _jsonl_row(path: Path, number: int, row: dict, kind: str) -> tuple[float, int, int, tuple[int, ...]]:
    (unit, _), block = _JSONL[kind]
    for key in ("timestamp", "input_length", "output_length"):
        if key not in row:
            raise TraceError(path, f"missing field {key!r}", number)
    stamp = row["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not _finite(stamp):
        raise TraceError(path, f"bad timestamp {str(stamp)[:40]!r}: not a number of {unit} ({kind})", number)
    if stamp < 0:
        raise TraceError(path, f"bad timestamp {stamp!r}: negative", number)
    hashes = row.get("hash_ids", [])
    if not isinstance(hashes, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hashes
    ):
        raise TraceError(path, "bad hash_ids: not a list of integers", number)
    prompt = _count(path, number, "input_length", row["input_length"])
    if len(hashes) > -(-prompt // block):  # more ids than the prompt has blocks: hashed in smaller ones
        raise TraceError(path, f"bad hash_ids: {len(hashes)} for {prompt} input tokens, where a {kind} hash id "
                               f"covers {block} tokens (at most {-(-prompt // block)}): a trace hashed in other "
                               f"blocks is not {kind}'s", number)
    return float(stamp), prompt, _count(path, number, "output_length", row["output_length"]), tuple(hashes)
