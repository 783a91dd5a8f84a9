"""Parametrization of the property suites (attnlab.properties.session says from what).

Kernel tests are parametrized by (property, target, dtype), oracle tests by formulation.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.properties import suite
from attnlab.properties.session import LONG_SEQUENCE_PROPERTIES, Session, session_of
from attnlab.registry import names


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    session = session_of(metafunc.config)
    if "kernel_property" in metafunc.fixturenames:
        long_only = metafunc.definition.get_closest_marker("long_sequences") is not None
        params = []
        for target in session.targets:
            for dtype in session.dtypes:
                checks_seen = set()
                for prop in suite.applicable(target, session.selection.passes_or_default):
                    check = suite.base_name(prop.name)
                    if long_only and check not in LONG_SEQUENCE_PROPERTIES:
                        continue
                    marks = () if dtype in target.dtypes else (
                        pytest.mark.skip(reason=f"{target.label} cannot run {_dtype_id(dtype)} here (Triton interpreter)"),)
                    if not marks and not session.runs(prop, target, dtype):
                        marks = (pytest.mark.skip(reason=f"{target.label}'s {_dtype_id(dtype)} backward under the "
                                                  "interpreter: --attnlab-profile thorough (session.INTERPRETER_BACKWARD_DTYPES)"),)
                    if session.slow(prop, target, dtype, check not in checks_seen):
                        marks += (pytest.mark.slow,)
                    checks_seen.add(check)
                    # A check's gradients share their cases and one backward pass per case (checks.gradient_run's
                    # cache): one xdist worker takes them all (--dist loadgroup). The long-sequence variant draws
                    # other cases: a group of its own, free to run beside the check's.
                    group = f"{check}-{target.label}-{_dtype_id(dtype)}" + ("-long" if long_only else "")
                    marks += (pytest.mark.xdist_group(group),)
                    params.append(pytest.param(prop, target, dtype, marks=marks,
                                               id=f"{prop.name}-{target.label}-{_dtype_id(dtype)}"))
        metafunc.parametrize("kernel_property,target,dtype", params)
    if "formulation_name" in metafunc.fixturenames:
        chosen = [session.selection.formulation] if session.selection.formulation else names()
        metafunc.parametrize("formulation_name", chosen)


@pytest.fixture(scope="session")
def attnlab_session(pytestconfig: pytest.Config) -> Session:
    return session_of(pytestconfig)

