"""The soak's controller: which fault, on which process, when (``tests.chaos.faults`` says
what each fault does).

Faults come at random moments (``--fault-interval-s`` on average), one (action, target kind)
after another in shuffled rounds, so each is played equally often whatever the number of
processes of a kind; a target already down or under another fault waits for its turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import TYPE_CHECKING

import httpx

from tests.chaos.faults import (
    DISK_FULL,
    FREEZE,
    KILL,
    NATS_ONLY,
    fill_disk,
    freeze,
    planned_s,
    slow_down,
)
from tests.chaos.targets import Fault, Target

if TYPE_CHECKING:
    from tests.chaos.stack import Stack

log = logging.getLogger("soak")


class FaultController:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def moves(self) -> list[tuple[str, str]]:
        """Each (action, target kind) the controller plays once per round."""
        kinds = sorted({t.kind for t in self.stack.targets if t.faulted})
        return sorted(
            (action, kind)
            for kind in kinds
            for action in self.stack.actions
            if action not in NATS_ONLY or kind == "nats"
        )

    async def inject_faults(
        self, stop: asyncio.Event, rng: random.Random, mean_interval_s: float, max_down_s: float
    ) -> list[Fault]:
        """At random moments until ``stop``, one fault on a random running target: a SIGKILL
        (it comes back after a random downtime), a freeze, nats-server's disk full or its
        answers slow (``tests.chaos.faults``); each ends beside the next faults."""
        faults: list[Fault] = []
        ending: set[asyncio.Task[None]] = set()
        moves = self.moves()
        order: list[tuple[str, str]] = []
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.uniform(0.3, 1.7) * mean_interval_s)
            if stop.is_set():
                break
            # Moves in shuffled rounds: each (action, kind) equally often, whatever the kind's
            # process count.
            if not order:
                order = rng.sample(moves, len(moves))
            chosen = await self._next_target(order, rng)
            if chosen is None and len(order) < len(moves):
                # Every move left in this round is on a target down or busy (a gateway loading
                # its model: tens of seconds on a busy machine; one frozen for 30): the next
                # round starts, so the faults keep their pace; the moves left are in it once,
                # at the head of the line.
                others = [m for m in moves if m not in order]
                order[:0] = rng.sample(others, len(others))
                chosen = await self._next_target(order, rng)
            if chosen is None:  # every target is down or busy: at the next moment
                continue
            action, target = chosen
            fault = Fault(
                self.stack.elapsed(),
                target.name,
                target.pid or -1,
                planned_s(action, rng, max_down_s),
                wall=time.time(),
                action=action,
            )
            faults.append(fault)
            log.info(
                "fault %d: %s %s (pid %d) for %.1fs",
                len(faults),
                action,
                target.name,
                fault.pid,
                fault.downtime_s,
            )
            task = asyncio.create_task(self._play(action, target, fault, stop, rng))
            ending.add(task)
            task.add_done_callback(ending.discard)
        await asyncio.gather(*ending)
        return faults

    async def _play(
        self, action: str, target: Target, fault: Fault, stop: asyncio.Event, rng: random.Random
    ) -> None:
        if action == KILL:
            if target.url:  # its counters die with it
                await self.stack.read_gateway_counters([target])
            target.wanted = False
            target.kill()
            await self._bring_back(target, fault)
            return
        target.busy = True  # each of these sets it back when it ends
        if action == FREEZE:
            await freeze(target, fault, stop, self.stack.elapsed)
        elif action == DISK_FULL:
            await fill_disk(target, self.stack.disk, fault, stop, self.stack.elapsed)
        else:
            await slow_down(target, self.stack.delay_file, fault, stop, rng, self.stack.elapsed)
        log.info("%s %s over: %s", action, target.name, fault.detail or "resumed")

    async def _next_target(
        self, order: list[tuple[str, str]], rng: random.Random
    ) -> tuple[str, Target] | None:
        """A target of the next move in ``order`` (popped from its end) that is up and under
        no other fault. A move whose kind is down or busy, or on a gateway whose fleet is not
        whole (``_fleet_listening``), keeps its place and comes as soon as it can in this
        round; the next move is played meanwhile, so the faults keep their pace."""
        for i in reversed(range(len(order))):
            action, kind = order[i]
            up = [
                t
                for t in self.stack.targets
                if t.kind == kind and t.wanted and t.running and not t.starting and not t.busy
            ]
            if up and await self._fleet_listening(kind):
                del order[i]
                return action, rng.choice(up)
        return None

    async def _fleet_listening(self, kind: str) -> bool:
        """Whether a target of ``kind`` may be killed now: with two gateways, one only while
        both answer HTTP (their 503 while the log is down included). A restarted gateway loads
        its model for seconds (tens on a busy 2-core machine); killing the other meanwhile made
        most of a soak an outage of every gateway, while what two gateways are for here is
        their seam: the other one serves the sessions meanwhile. The one-gateway soak still
        kills its only gateway."""
        if self.stack.gateways == 1 or not kind.startswith("gateway"):
            return True
        async with httpx.AsyncClient(timeout=2.0) as client:
            for port in self.stack.gateway_ports:
                try:
                    await client.get(f"http://127.0.0.1:{port}/health")
                except httpx.HTTPError:
                    return False
        return True

    async def _bring_back(self, target: Target, fault: Fault) -> None:
        await asyncio.sleep(fault.downtime_s)
        target.wanted = True  # the supervisor starts it
        await target.up.wait()
        fault.back_after_s = self.stack.elapsed() - fault.at_s
