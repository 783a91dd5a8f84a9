"""The float64 oracles on adversarial inputs: identities of exact arithmetic, to 1e-12.

tests/test_oracles.py checks the oracles on the registry's default inputs
(and certifies them with mpmath); here hypothesis moves the inputs to where
arithmetic breaks (attnlab.properties.strategies). These test attnlab's
references, not a third party's kernel: with ``--attnlab-kernel`` they are
skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import hypothesis
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab.properties import checks, traits
from attnlab.properties.checks import CheckResult
from attnlab.properties.strategies import Sizes, cases
from attnlab.registry import formulation

ORACLE_SIZES = Sizes(max_T=48, max_dim=12, max_B=2)
# float64 has fp32's exponent range and more: the thresholds of fp32 are the ones to pass.
PROBE_DTYPE = torch.float32


@pytest.fixture(autouse=True)
def _own_references_only(pytestconfig: pytest.Config) -> None:
    if pytestconfig.getoption("attnlab_kernel", None):
        pytest.skip("oracle properties test attnlab's references; skipped with --attnlab-kernel")


def _search(label: str, strategy: st.SearchStrategy, check: Callable[..., CheckResult]) -> None:
    """Run ``check`` on hypothesis' draws from ``strategy``, steering toward the largest figure / bound."""

    def check_one(drawn: tuple) -> None:
        result = check(*drawn)
        hypothesis.target(result.score, label=f"log({result.property} figure / bound)")
        result.assert_held()

    test = given(strategy)(check_one)
    test._hypothesis_internal_add_digest = label.encode()  # type: ignore[attr-defined]
    test()


def test_forms_agree(formulation_name: str) -> None:
    strategy = st.tuples(st.one_of(cases(formulation_name, PROBE_DTYPE, ORACLE_SIZES),
                                   cases(formulation_name, PROBE_DTYPE, ORACLE_SIZES, overflow=True)),
                         st.integers(1, 20))
    _search(f"forms_agree|{formulation_name}", strategy, checks.check_forms_agree)


def test_reductions_hold_exactly(formulation_name: str) -> None:
    reductions = traits.reductions_of(formulation_name)
    if not reductions:
        pytest.skip(f"{formulation_name} has no special case")
    strategy = st.one_of(*[st.tuples(st.just(r), cases(r.special, PROBE_DTYPE, ORACLE_SIZES, options=r.special_options))
                           for r in reductions])
    _search(f"oracle_reduction|{formulation_name}", strategy, checks.check_oracle_reduction)


def test_ut_inverse_entries_are_bounded(formulation_name: str) -> None:
    if not traits.is_delta_rule(formulation(formulation_name)):
        pytest.skip(f"{formulation_name} is not a delta rule")
    strategy = st.tuples(cases(formulation_name, PROBE_DTYPE, Sizes(max_T=64, max_dim=16)))
    _search(f"ut_inverse|{formulation_name}", strategy, checks.check_ut_inverse_bounded)


def test_decay_products_never_grow(formulation_name: str) -> None:
    if not checks.single_matrix_state(formulation_name):
        pytest.skip(f"{formulation_name} has no single state matrix")
    strategy = st.tuples(cases(formulation_name, PROBE_DTYPE, ORACLE_SIZES))
    _search(f"decay_products|{formulation_name}", strategy, checks.check_decay_products_contract)
