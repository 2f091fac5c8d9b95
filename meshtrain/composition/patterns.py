"""Refusal rows written once for several features: a `Pattern` is a row with the feature's
name, flag and reason left as ``{name}``, ``{flag}`` and ``{exchange}``, a `Scheme` is one
feature it is written for, and `ForEach` stands in the table for the rows they make
(`rows` writes them out)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from meshtrain.composition.checks import Check, Value, all_of
from meshtrain.composition.examples import Example
from meshtrain.composition.refusal import Refusal

__all__ = ["ForEach", "Pattern", "Scheme", "cells", "rows"]


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A feature several rows are written for (a way for the replicas to step on their own).

    Args:
        name: how the rows name it (``"local SGD"``).
        ids: its feature ids in the composition matrix.
        on: ``run → bool``: whether a run has it.
        field: its setting, where the rows file their problem.
        value: ``run → value`` of `field`.
        flag: its flag (``"--sync-every"``).
        settings: the `SyncConfig` fields that turn it on, for the examples.
        exchange: why it exchanges no gradients (its row against gradient compression).
    """

    name: str
    ids: tuple[str, ...]
    on: Check
    field: str
    value: Value
    flag: str
    settings: dict
    exchange: str = ""


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A row of the table written for each `Scheme`; ``{name}``, ``{flag}`` and ``{exchange}``
    in its texts stand for the scheme's.

    Args:
        first: as `Refusal.first`; ``"{name}"`` where the scheme is the first feature.
        second: as `Refusal.second`.
        reason: as `Refusal.reason`.
        when: ``run → bool``, checked beside the scheme's `Scheme.on`.
        fix: as `Refusal.fix`.
        example: the scheme's settings → the row's example.
        pairs_with: the feature ids the scheme's ids form refused cells with.
        ids_first: whether the scheme's id comes first in each cell.
        field: the setting; None: the scheme's own.
        value: ``run → value`` of `field`; None: the scheme's own.
        only: the names of the schemes the row is written for; empty: every one.
        touches: the feature ids the scheme's ids form cells with that the row refuses only
            under a further setting (`Refusal.touches`), in `ids_first`'s order.
    """

    first: str
    second: str
    reason: str
    when: Check
    fix: str
    example: Callable[[dict], Example]
    pairs_with: tuple[str, ...] = ()
    ids_first: bool = True
    field: str | None = None
    value: Value | None = None
    only: tuple[str, ...] = ()
    touches: tuple[str, ...] = ()

    def row(self, scheme: Scheme) -> Refusal:
        """The row for `scheme`."""
        texts = {"name": scheme.name, "flag": scheme.flag, "exchange": scheme.exchange}
        if self.ids_first:
            refused = cells(scheme.ids, self.pairs_with)
            touched = cells(scheme.ids, self.touches)
        else:
            refused = cells(self.pairs_with, scheme.ids)
            touched = cells(self.touches, scheme.ids)
        return Refusal(
            self.first.format(**texts),
            self.second.format(**texts),
            self.reason.format(**texts),
            all_of(scheme.on, self.when),
            self.field or scheme.field,
            self.fix.format(**texts),
            self.value or scheme.value,
            self.example(scheme.settings),
            cells=refused,
            touches=touched,
        )


@dataclasses.dataclass(frozen=True)
class ForEach:
    """The rows of `patterns` for each of `schemes`, scheme by scheme, in the table's place."""

    patterns: tuple[Pattern, ...]
    schemes: tuple[Scheme, ...]


def cells(firsts: tuple[str, ...], seconds: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Every matrix cell of one id of `firsts` with one of `seconds`."""
    return tuple((a, b) for a in firsts for b in seconds)


def rows(table: Iterable[Refusal | ForEach]) -> tuple[Refusal, ...]:
    """The table's rows in order, each `ForEach` written out."""
    out: list[Refusal] = []
    for entry in table:
        if isinstance(entry, Refusal):
            out.append(entry)
            continue
        for scheme in entry.schemes:
            out += [p.row(scheme) for p in entry.patterns if scheme.name in p.only or not p.only]
    return tuple(out)
