"""The pytest items of an ``attnlab campaign`` run (attnlab.commands.campaign), one per plan item.

``attnlab campaign`` runs this file under pytest-xdist with ``ATTNLAB_CAMPAIGN_PLAN`` naming the plan; its name
does not match ``test_*.py``, so no test run collects it otherwise. An item passes when its property held (or was
imprecise: the campaign's report grades it), fails with the finding otherwise; its result is in the campaign's
``results/`` whatever pytest makes of it.
"""

from __future__ import annotations

import os

import pytest

from attnlab.commands.campaign import PLAN_ENV, load_plan, run_item
from attnlab.commands.campaign_report import node_id

if not os.environ.get(PLAN_ENV):
    pytest.skip(f"an attnlab campaign's items: run by attnlab campaign ({PLAN_ENV} names the plan)",
                allow_module_level=True)

PLAN = load_plan(os.environ[PLAN_ENV])


@pytest.mark.parametrize("key", PLAN["todo"], ids=node_id)
def test_item(key: str) -> None:
    record = run_item(PLAN, key)
    if record["status"] not in ("held", "imprecise", "not applicable"):
        bad = next((v for v in record.get("verdicts", []) if v["status"] not in ("held", "imprecise")), {})
        pytest.fail(f"{record['status']}: {bad.get('property', '')} {bad.get('figure_text') or ''} "
                    f"{bad.get('detail') or record.get('detail', '')}"[:2000], pytrace=False)
