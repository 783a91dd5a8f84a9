"""attnlab.properties: hypothesis strategies, property checks, known-bad specimens and the suites that run them.

- ``strategies``: :class:`~attnlab.properties.strategies.Case` (a seed, shapes and
  distribution parameters; its repr reproduces it) and ``cases(name, dtype, sizes, ...)``;
- ``checks``: the property checks, plain functions returning a ``CheckResult``;
- ``targets``: what the kernel checks run on (attnlab's kernels, ``module:function``, specimens);
- ``suite``: the default kernel property suite and its hypothesis driver;
- ``specimens``: deliberately broken kernels, each with the property that must catch it;
- ``traits``: what the properties read off the registry (and the few facts it lacks);
- ``regressions``: counterexamples kept as ``@example`` regressions;
- ``test_*.py``: the pytest suites (``pytest --pyargs attnlab.properties``, see attnlab.pytest_plugin).
"""
