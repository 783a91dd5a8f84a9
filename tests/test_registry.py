"""The registry entries are complete and consistent, and generic code reads them instead of branching on names.

DESIGN.md: adding an eleventh formulation should mean one registry entry, one oracle module and one kernel
module. That holds only while (a) every entry declares what generic code needs (roles, the facts the
properties rest on, reductions, peers) and (b) no generic module compares a formulation's name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.metrics import rel_err
from attnlab.registry import BOUNDS
from attnlab.spec import ROLES, Formulation

ROOT = Path(__file__).resolve().parent.parent
NAMES = attnlab.names()
ENTRIES = list(attnlab.REGISTRY)
TOL = 1e-12


def _ids(f: Formulation) -> str:
    return f.name


def small(f: Formulation, seed: int = 0) -> dict[str, torch.Tensor]:
    return f.sample(B=1, T=9, H=2, K=4, V=3, seed=seed)


# ----------------------------------------------------------------------------- (a) every entry complete


@pytest.mark.parametrize("f", ENTRIES, ids=_ids)
def test_every_argument_has_a_role_and_the_roles_make_a_function(f: Formulation) -> None:
    assert all(a.role in ROLES for a in f.args), [(a.name, a.role) for a in f.args]
    assert len(f.args_with_role("value")) == 1, "one value argument: the output's dims are its dims"
    assert len(f.args_with_role("key")) == 1
    assert len(f.args_with_role("query")) <= 1
    if "scale" in f.option_names and f.option("scale").default is None:
        assert f.args_with_role("query"), "a default scale K ** -0.5 needs a query to read K from"


@pytest.mark.parametrize("f", ENTRIES, ids=_ids)
def test_the_facts_refer_to_what_the_entry_declares(f: Formulation) -> None:
    keys = {a.name for a in f.args_with_role("key")}
    assert set(f.shift_invariant) <= keys, "shift invariance is declared on keys"
    assert not (f.shift_invariant and f.bilinear_logits)
    if f.bilinear_logits:
        assert f.args_with_role("query") and f.args_with_role("key")
    if f.convex_when is not None:
        for name, value in f.convex_when:
            option = f.option(name)
            assert option.choices is None or value in option.choices
    assert set(f.form_options) <= set(f.forms)
    naive = {o.name for options in f.form_options.values() for o in options}
    assert {name for name, _ in f.naive_options} <= naive
    for m in f.stability:
        assert set(m.args) <= set(f.arg_names)
    assert set(f.bounds) <= set(BOUNDS)


@pytest.mark.parametrize("f", ENTRIES, ids=_ids)
def test_shift_facts_are_declared_consistently(f: Formulation) -> None:
    """Additive keys (no query reads them) are declared shift-invariant, and are; bilinear logits need a query;
    keys read through a state (linear attention and the gated and delta forms) are not shift-invariant.

    Softmax's keys are invariant too (q.(k_i + c) moves every logit of a query row by the same q.c), but its
    facts are its bilinear logits: the shift a strategy draws for them is ``logit_max``, not ``key_shift``.
    """
    x = small(f)
    key = f.args_with_role("key")[0].name
    run = attnlab.oracle(f, "recurrent")
    change = rel_err(run(**{**x, key: x[key] + 3.0}), run(**x))
    if not f.args_with_role("query"):
        assert f.shift_invariant == (key,), "additive keys enter an exponential: declare them shift-invariant"
    if f.shift_invariant:
        assert change <= TOL, change
    elif not f.bilinear_logits:
        assert change > 1e-3, change


@pytest.mark.parametrize("f", [f for f in ENTRIES if f.reductions], ids=_ids)
def test_every_reduction_names_a_registered_formulation_whose_arguments_it_produces(f: Formulation) -> None:
    for r in f.reductions:
        assert r.special in NAMES and r.special != f.name
        special = attnlab.formulation(r.special)
        assert {n for n, _ in r.special_options} <= set(special.option_names)
        x = {**small(special), **dict(r.special_options)}
        general = r.to_general(x)
        assert set(general) <= set(f.arg_names) | set(f.option_names), set(general) - set(f.arg_names)
        assert {a.name for a in f.args if not a.optional} <= set(general)
        assert rel_err(attnlab.oracle(f, "recurrent")(**general), attnlab.oracle(special, "recurrent")(**x)) <= TOL


FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@pytest.mark.parametrize("f", [f for f in ENTRIES if f.peers], ids=_ids)
def test_every_peer_is_declared_completely(f: Formulation) -> None:
    assert sum(p.bench for p in f.peers) <= 1, "at most one bench peer"
    arguments, options = set(f.arg_names), set(f.option_names)
    for p in f.peers:
        c = p.convention
        assert FUNCTION.match(p.function), p.function
        assert p.library and p.label
        assert f.peer(p.library, p.attribute) is p
        assert set(c.names) <= arguments | options, c.names
        assert set(c.positional) <= arguments and set(c.derived) <= arguments and set(c.arg_dtypes) <= arguments
        assert set(c.implied) <= options and {n for n, _ in p.our_options} <= options
        assert c.layout in ("BTHD", "BHTD") and c.gates in ("log", "linear") and c.state in ("KV", "VK")
        assert c.returns in ("attnlab", "o", "o_state")
        assert not c.feature_map_outside or "feature_map" in options
        assert not c.decay_rate_as_log or f.args_with_role("decay_rate")
        assert not c.gates == "linear" or f.args_with_role("log_gate")
        if f.state is None:
            assert not c.stacked_state and not c.carries
        else:
            assert all(set(parts) <= set(f.state.names) for _, parts in c.carries)
            assert set(c.part_unsqueeze) <= set(f.state.names)


def test_every_formulation_is_timed_against_a_peer_where_it_has_one() -> None:
    for f in ENTRIES:
        assert (f.bench_peer is None) == (not f.peers), f.name


# ----------------------------------------------------------------------------- (b) no branching on names

# Per-formulation files, where a formulation's name is the subject: oracles/<name>.py, kernels/<name>.py,
# tests/kernels/test_<name>.py and the registry itself.
PER_FORMULATION = {"attnlab/registry.py", *(f"oracles/{n}.py" for n in NAMES), *(f"kernels/{n}.py" for n in NAMES),
                   *(f"tests/kernels/test_{n}.py" for n in NAMES)}

def generic_modules() -> list[Path]:
    """Every module of attnlab/ (commands included), properties/ (not its test modules) and tests/*.py."""
    found = [*sorted((ROOT / "attnlab").rglob("*.py")),
             *sorted(p for p in (ROOT / "properties").glob("*.py") if not p.name.startswith("test_")),
             *sorted((ROOT / "tests").glob("*.py"))]
    return [p for p in found if p.relative_to(ROOT).as_posix() not in PER_FORMULATION]


class _NameBranches(ast.NodeVisitor):
    """String constants equal to a formulation's name in a comparison, membership test or dict key.

    A comparison inside an ``assert`` statement checks a result (``rows[0]["formulation"] == "gla"``), it
    does not branch: those are not counted.
    """

    def __init__(self, path: str) -> None:
        self.path, self.scope, self.hits = path, ["<module>"], []

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(".".join([*self.scope[1:], node.name]))
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Assert(self, node: ast.Assert) -> None:
        if node.msg is not None:
            self.visit(node.msg)

    def _names_in(self, node: ast.AST | None):
        if isinstance(node, ast.Constant) and node.value in NAMES:
            yield node
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                yield from self._names_in(element)

    def _hit(self, node: ast.Constant, kind: str) -> None:
        self.hits.append((self.path, self.scope[-1], node.value, kind, node.lineno))

    def visit_Compare(self, node: ast.Compare) -> None:
        membership = any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
        for side in (node.left, *node.comparators):
            for constant in self._names_in(side):
                self._hit(constant, "membership" if membership else "comparison")
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key in node.keys:
            for constant in self._names_in(key):
                self._hit(constant, "dict key")
        self.generic_visit(node)


def name_branches() -> list[tuple[str, str, str, str, int]]:
    hits = []
    for path in generic_modules():
        visitor = _NameBranches(path.relative_to(ROOT).as_posix())
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        hits += visitor.hits
    return hits


def test_the_scan_sees_a_branch_on_a_name() -> None:
    visitor = _NameBranches("example.py")
    visitor.visit(ast.parse(f"def f(name):\n    if name == {NAMES[0]!r} or name in ({NAMES[1]!r},):\n"
                            f"        return {{{NAMES[2]!r}: 1}}\n    assert name != {NAMES[3]!r}\n"))
    assert [(h[1], h[2], h[3]) for h in visitor.hits] == [("f", NAMES[0], "comparison"), ("f", NAMES[1], "membership"),
                                                          ("f", NAMES[2], "dict key")]


def test_generic_modules_never_branch_on_a_formulation_name() -> None:
    hits = name_branches()
    assert not hits, "generic code compares a formulation's name; read the registry entry instead:\n" + "\n".join(
        f"  {path}:{line} in {scope}: {name!r} as a {kind}" for path, scope, name, kind, line in hits)
