"""After a failed engine step: find the request(s) that made it fail, fail only them, go on.

The suspects are the requests added since the last good step: they have produced nothing
yet, so aborting and re-adding one loses nothing (a seeded one restarts from its seed).
All of them are set aside and the rest step alone; if that fails too the failure is not
theirs and the caller fails the batch. Otherwise they come back by halves, each group
stepped once: a group whose step fails is set aside again and split, down to the single
requests that fail on their own. A failure later in a request's life (not at its first
step) is not attributed this way; the caller fails the batch (docs/SERVER.md).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from specdec.outputs import RequestOutput

logger = logging.getLogger("specdec.server")


@dataclass
class StepIsolation:
    step: Callable[[], list[RequestOutput]]
    has_work: Callable[[], bool]
    add: Callable[[list[str]], None]  # re-add these (raises if one cannot be added)
    abort: Callable[[list[str]], None]
    deliver: Callable[[list[RequestOutput]], None]  # a probe step's outputs, to their clients
    fail: Callable[[str, BaseException], None]  # an offender, with its step's error

    def isolate(self, suspects: list[str]) -> tuple[bool, bool]:
        """(found, controlled): whether the failure was pinned on suspects (now failed), and whether
        a step without them succeeded, which tells a bad request from an engine that fails every step.
        (False, _): the rest fail without the suspects too."""
        if not suspects:
            return False, False
        self.abort(suspects)
        controlled = self.has_work()
        if controlled:
            try:
                self.deliver(self.step())
            except Exception:  # noqa: BLE001 - the others fail alone: not the suspects' doing
                logger.exception("the step still fails without the %d newest requests", len(suspects))
                return False, True
        groups = [suspects]
        found = False
        while groups:
            group = groups.pop()
            try:
                self.add(group)
                self.deliver(self.step())
                continue
            except Exception as e:  # noqa: BLE001 - this group holds an offender
                self.abort(group)
                if len(group) == 1:
                    logger.warning("request %s makes the engine step fail (%r); failing it alone", group[0], e)
                    self.fail(group[0], e)
                    found = True
                else:
                    mid = len(group) // 2
                    groups += [group[mid:], group[:mid]]
        return found, controlled
