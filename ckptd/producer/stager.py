"""The one staging sequence of ``emit``, ``emit_many`` and ``save``: plan, copy, hand over.

Every tensor enters staging through ``Stager`` under the producer's emit lock, in one
order: grow staging between steps (``grow``), claim the names in the step's book, copy,
hand the copy to the connection. A layout saved before copies by its cached plan
(``by_plan``); any other goes the general way (``stage``, through ``copies.Copier``)
and gets a plan for next time (``keep``). This module never touches a tensor itself.
"""

from __future__ import annotations

import threading
from typing import Any

from ..state import flatten
from .connection import Connection
from .copies import Copier, Item, frozen_first, same_item
from .frozen import Frozen
from .plan import Plan
from .steps import Step, StepBook

PLANS_KEPT = 4


class Stager:
    """The producer's staging sequence over its parts: ``Copier`` (staging and copies),
    ``Connection`` (the daemon), ``StepBook`` (the steps in flight) and ``Frozen``."""

    def __init__(self, copier: Copier, connection: Connection, book: StepBook, frozen: Frozen,
                 lock: threading.Lock) -> None:
        self._copier, self._connection, self._book, self._frozen = copier, connection, book, frozen
        self.lock = lock
        self.save_plans: list[Plan] = []
        self.many_plans: list[Plan] = []

    def by_plan(self, plans: list[Plan], state: Any, step: int, *, kick: bool) -> Any:
        """Stage ``state`` by the newest of ``plans`` that serves it and hand it over; what the
        plan's ``collect`` gave, or None (nothing done) where none serves: then the caller
        goes the general way. ``kick``: wake the sender at once if this opens the step
        (a save's commit, right after, does that itself)."""
        found = None
        for plan in reversed(plans):
            got = plan.collect(state)
            if got is not None:
                found = plan, got
                break
        if found is None:
            return None
        plan, got = found
        with self.lock:
            self.grow()
            if not self._connection.ready_for_plan() or plan not in plans:
                return None
            region = self._copier.take(plan)
            if region is None:
                return None
            shipped = False

            def ship(part: list[Any]) -> None:
                nonlocal shipped
                if not shipped:
                    self._book.claim(step, *plan.names, room=plan.room)
                    self._book.opened(step)
                    shipped = True
                self._connection.send_planned(step, None, part, kick=True)

            try:
                messages = self._copier.copy_planned(plan, region, got[0], ship)
            except BaseException:
                if shipped:  # the region goes back once the daemon has read what was shipped
                    self._connection.send_planned(step, region, [], kick=True)
                raise
            if messages is None:
                plans.remove(plan)
                return None
            if not shipped:
                try:
                    self._book.claim(step, *plan.names, room=plan.room)
                except BaseException:
                    self._copier.release(region)
                    raise
            opened = self._book.opened(step)
            self._connection.send_planned(step, region, messages, kick=kick and not opened)
            plans.remove(plan)
            plans.append(plan)
        return got

    def stage(self, step: int, items: dict[str, Item], *, room: int, grow_for: int | None = None,
              piece: Any = None, frozen: Any = None, written_by: dict[str, int] | None = None) -> Step:
        """Under ``lock``: claim ``items`` in ``step`` (taking ``room`` bytes of staging;
        ``piece``: the one item is a hand-placed piece; ``written_by``: tensors another rank
        writes, ``{name: that rank}``) and stage each, in order. Staging grows first, for
        ``grow_for`` bytes (default ``room``; 0: the last checkpoint's). ``frozen``: globs
        of tensors the daemon stores already, described (``same``) instead of staged. On
        an error, the names not staged are given back."""
        self.grow(room if grow_for is None else grow_for)  # first: a claimed step is in flight
        if written_by:
            for name, writer in written_by.items():
                self._book.claim(step, name, written_by=writer)
        st = self._book.claim(step, *items, room=room, piece=piece)
        if frozen is not None:
            self._send_same(step, items, frozen)
            items = frozen_first(items, frozen)
        staged = 0
        try:
            for name, item in items.items():
                self._connection.ensure()
                self._copier.stage(self._connection, st, step, name, item)
                staged += 1
        except BaseException:
            give_back = room if staged == 0 else 0
            for name in list(items)[staged:]:
                self._book.unclaim(step, name, give_back, piece)
                give_back = 0
            raise
        return st

    def keep(self, plans: list[Plan], state: Any, structure: Any, tensors: dict[str, Any],
             items: dict[str, Item], room: int) -> None:
        """After the general way (under ``lock``): a plan for the next call with ``state``'s
        layout, where one serves (every tensor a plain CPU torch tensor, staged whole)."""
        if not self._connection.batches() or len(items) != len(tensors) \
                or any(i.shard is not None or i.is_numpy or i.is_cuda for i in items.values()):
            return
        plan = self._copier.plan(state, structure, tensors, room)
        if plan is not None:
            plans[:] = [*plans[-(PLANS_KEPT - 1):], plan]

    def keep_many(self, tensors: dict[str, Any], items: dict[str, Item], room: int) -> None:
        """``keep`` for ``emit_many``'s ``{name: tensor}``, whose names are its own."""
        structure, flat = flatten(tensors)
        if list(flat) == list(items):
            self.keep(self.many_plans, tensors, structure, flat, items, room)

    def grow(self, room: int = 0) -> None:
        """Swap in a grown arena (sizing) while no step is in flight; under ``lock``.
        ``room``: the staging the checkpoint about to be staged takes, where known (a
        save; else, for emits, the last checkpoint's): one that the arena cannot hold
        gets a larger one to stream through at once (``Copier.regrow``).

        The daemon maps an arena for the life of a connection, so the new one comes
        with a new connection: a bye, then the next send says hello with it."""
        old = self._copier.regrow(room, idle=self._book.idle)
        if old is None:
            return
        self._connection.drop()
        for plan in self.save_plans + self.many_plans:
            plan.forget_views()
        self._copier.retire(old)

    def _send_same(self, step: int, items: dict[str, Item], pattern: Any) -> None:
        """Describe the frozen tensors the daemon stores already (``same``) and take them
        out of ``items``, which are staged after: before any tensor, so the message opens
        the step and the daemon links them first."""
        base, same = self._frozen.split(step, items, pattern, same_item)
        if not same:
            return
        self._connection.ensure()
        self._connection.send_batch()
        self._connection.send("same", step=step, base=base, items=same)
        self._book.opened(step)
