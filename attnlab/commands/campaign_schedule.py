"""How a campaign's items are handed to pytest-xdist's workers: each worker keeps to one cell (kernel, dtype).

A kernel library's first call in a process compiles (and autotunes) its kernels: minutes for fla's on a fresh
machine, against seconds or less for every later call of the same kernels in that process, whatever the lengths
(fla does not specialize on T). pytest-xdist's ``load`` scheduling hands each worker whatever items come next, so
one cell's items end up on many workers and each compiles the cell again. :class:`CellScheduling` is ``load``
scheduling (its batches, its re-queueing of a dead worker's items) with one change, which items a worker is sent:

1. the first pending item of a cell no worker has started, with more of that cell (every cell starts as soon as a
   worker is free, in plan order: the plan puts each cell's first item ahead of every cell's second);
2. else more items of the cell the worker ran last;
3. else items of the cell of the first pending item (a worker whose cell is done helps with another).

Not pytest-xdist's ``loadgroup``: in pytest-xdist 3.8 a worker that dies inside a group hangs the run, and a
kernel that crashes its process is one thing a campaign must survive. Loaded into the campaign's pytest run with
``-p`` (attnlab.commands.campaign.pytest_command); the controller asks it for the scheduler.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from xdist.scheduler import LoadScheduling

from attnlab.commands.campaign_report import node_id


class CellScheduling(LoadScheduling):
    """pytest-xdist's ``load`` scheduling, each batch drawn from one cell; ``cell_of`` maps a node id to its cell."""

    def __init__(self, config: pytest.Config, log: Any = None, cell_of: Callable[[str], str] = str) -> None:
        super().__init__(config, log)
        self.cell_of = cell_of
        self.started: set[str] = set()
        self.node_cell: dict[Any, str] = {}

    def next_cell(self, node: Any) -> str | None:
        """The cell ``node`` gets its next items from (the module docstring's order); None when nothing is pending."""
        assert self.collection is not None
        pending = [self.cell_of(self.collection[i]) for i in self.pending]
        own = self.node_cell.get(node)
        for cell in pending:
            if cell not in self.started:
                return cell
        if own in pending:
            return own
        return pending[0] if pending else None

    def _send_tests(self, node: Any, num: int) -> None:
        cell = self.next_cell(node)
        if cell is None:
            return
        assert self.collection is not None
        chosen = [i for i in self.pending if self.cell_of(self.collection[i]) == cell][:num]
        taken = set(chosen)
        self.pending[:] = [i for i in self.pending if i not in taken]
        self.started.add(cell)
        self.node_cell[node] = cell
        self.node2pending[node].extend(chosen)
        node.send_runtest_some(chosen)


def cell_lookup(items: Sequence[dict[str, Any]]) -> Callable[[str], str]:
    """node id (``...::test_item[<item id>]``) -> "kernel/dtype", from the plan's items; an unknown id is its own
    cell."""
    cells = {node_id(i["key"]): f"{i['kernel']}/{i['dtype']}" for i in items}

    def cell_of(nodeid: str) -> str:
        return cells.get(nodeid[nodeid.find("[") + 1:-1], nodeid)

    return cell_of


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScheduling | None:
    """The campaign's scheduler when it runs under ``--dist=load`` with a plan (attnlab.commands.campaign.PLAN_ENV)."""
    from attnlab.commands.campaign import PLAN_ENV, load_plan

    if config.getvalue("dist") != "load" or not os.environ.get(PLAN_ENV):
        return None
    return CellScheduling(config, log, cell_lookup(load_plan(os.environ[PLAN_ENV])["items"]))
