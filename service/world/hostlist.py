"""Slurm host lists (``gpu-[01-04,07],cpu1``): the first host and the count without expanding, or all of them.

A node list may name millions of hosts (``n[0-99999999]``); the launcher needs
only the first (``MASTER_ADDR``) and how many there are, so nothing here
expands a list unless asked, and never past :data:`MAX_EXPANDED_HOSTS`.
"""

from __future__ import annotations

import re


class HostlistError(ValueError):
    """A node list that does not parse, or is too large to expand; the message names it."""


MAX_EXPANDED_HOSTS = 100_000


def expand_hostlist(nodelist: str, limit: int = MAX_EXPANDED_HOSTS) -> list[str]:
    """Expand a Slurm hostlist such as ``gpu-[01-04,07],cpu1`` into host names, in order.

    Zero padding is kept (``[01-04]`` gives ``01``..``04``); brackets may appear
    more than once in one name (``r[1-2]n[1-2]``). A list of more than ``limit``
    hosts is refused before anything is expanded: the launcher needs only the
    first host and the count (:func:`first_host`, :func:`count_hosts`).
    """
    count = count_hosts(nodelist)
    if count > limit:
        raise HostlistError(
            f"The Slurm node list {nodelist[:80]!r} names {count} hosts, more than the {limit} this service "
            "expands. Check SLURM_JOB_NODELIST; a real allocation is far smaller."
        )
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def count_hosts(nodelist: str) -> int:
    """How many hosts a node list names, without expanding it (``n[0-99999999]`` is counted, not listed)."""
    total = 0
    for item in _split_top_level(nodelist.strip()):
        count = 1
        for match in _BRACKET.finditer(item):
            count *= sum(hi - lo + 1 for lo, hi, _ in _ranges(item, match.group(1)))
        total += count
    if total == 0:
        raise HostlistError(f"The Slurm node list {nodelist!r} names no host.")
    return total


def first_host(nodelist: str) -> str:
    """The first host of a node list (the rank-0 node), without expanding the rest."""
    items = _split_top_level(nodelist.strip())
    if not items:
        raise HostlistError(f"The Slurm node list {nodelist!r} names no host.")
    item = items[0]
    while (match := _BRACKET.search(item)) is not None:
        lo, _, width = _ranges(item, match.group(1))[0]
        item = f"{item[: match.start()]}{lo:0{width}d}{item[match.end() :]}"
    return item


def _split_top_level(text: str) -> list[str]:
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"The Slurm node list {text!r} has a ']' without a '['.")
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise HostlistError(f"The Slurm node list {text!r} has an unclosed '['.")
    items.append("".join(current))
    return [item for item in items if item]


_BRACKET = re.compile(r"\[([^\]]*)\]")


def _ranges(item: str, spec: str) -> list[tuple[int, int, int]]:
    """``01-04,07`` as (low, high, zero-padded width) triples; a bad or reversed range is an error."""
    ranges = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise HostlistError(f"The Slurm node list entry {item!r} has a bad range {part!r}.")
        ranges.append((int(lo), int(hi if sep else lo), len(lo)))
    return ranges


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    names = []
    for lo, hi, width in _ranges(item, match.group(1)):
        for number in range(lo, hi + 1):
            names.extend(_expand_one(f"{prefix}{number:0{width}d}{suffix}"))
    return names
