"""What the property suites run against in one pytest session, from the plugin's options.

The targets are the ``--attnlab-kernel`` function, or every attnlab kernel
that exists (filtered by ``--attnlab-formulation``); the dtypes are
``--attnlab-dtype`` or the device's defaults (float16 and float32 on the
CPU, bfloat16 and float16 on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, settings

from attnlab.evaluate import parse_dtype
from attnlab.properties import suite
from attnlab.properties.strategies import Sizes
from attnlab.properties.targets import Target, own_kernel_targets, resolve_in_convention
from attnlab.pytest_plugin import RESOLVED, Selection, default_dtypes, selection

# Under the Triton interpreter, attnlab's kernels' backward properties run in these dtypes unless the profile is
# "thorough": fp16, where the gradients meet real rounding; fp32's gradients of every kernel are held to the oracle by
# tests/test_kernel_gradients.py and the kernels' own tests, and the backward suite in both dtypes would double the
# test command's largest share (CI: a 2-core machine, 15 minutes).
INTERPRETER_BACKWARD_DTYPES = (torch.float16,)

# The backward checks whose first gradient the quick tier (make test) runs on attnlab's interpreted kernels
# (Session.slow).
QUICK_BACKWARD_CHECKS = ("backward_matches_oracle", "backward_causality")

# Examples per (property, target, dtype) for kernels under the Triton interpreter, whatever the profile's count:
# an interpreted call takes a good fraction of a second.
INTERPRETER_EXAMPLES = 2
LONG_SEQUENCE_EXAMPLES = 2


def _interpreted_own(target: Target) -> bool:
    """Whether ``target`` is one of attnlab's own kernels running under the Triton interpreter (slow: fewer
    examples, no shrinking, backward properties in fewer dtypes)."""
    from attnlab.kernel import interpreter_active

    return interpreter_active() and target.label.startswith("attnlab:")


@dataclass(frozen=True)
class Session:
    """What the suites run against in this session."""

    selection: Selection
    targets: tuple[Target, ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def device(self) -> str:
        return self.selection.device

    @property
    def sizes(self) -> Sizes:
        return suite.sizes_for(self.device, self.selection.profile)

    def runs(self, prop: suite.KernelProperty, target: Target, dtype: torch.dtype) -> bool:
        """Whether this session runs ``prop`` on ``target`` in ``dtype`` (see :data:`INTERPRETER_BACKWARD_DTYPES`)."""
        thorough = self.selection.profile == "thorough"
        return not (prop.name.startswith("backward_") and _interpreted_own(target) and not thorough
                    and dtype not in INTERPRETER_BACKWARD_DTYPES)

    def slow(self, prop: suite.KernelProperty, target: Target, dtype: torch.dtype, first_of_its_check: bool) -> bool:
        """Whether ``prop`` on ``target`` in ``dtype`` belongs to the slow tier (pytest's ``slow`` marker: ``make
        test-all``, not ``make test``). Under the Triton interpreter, on attnlab's own kernels: every property in
        fp32, and of the backward properties all but the first gradient of QUICK_BACKWARD_CHECKS. fp16 is where the
        kernels meet real rounding, and those two checks hold every kernel's backward to the oracle and to
        causality in every run; each further check, gradient and dtype costs the kernel's calls again under the
        interpreter, most of the test command's time (tests/test_kernels.py and tests/test_kernel_gradients.py hold
        every output and gradient of every kernel to the oracle in fp16 and fp32 in both tiers)."""
        if not _interpreted_own(target):
            return False
        if dtype == torch.float32:
            return True
        backward = prop.name.startswith("backward_")
        return backward and not (first_of_its_check and suite.base_name(prop.name) in QUICK_BACKWARD_CHECKS)

    def settings_for(self, target: Target, cap: int | None = None) -> settings:
        """The loaded profile, with fewer examples (or below ``cap``) and no shrinking for interpreted kernels.

        Shrinking a failure replays the kernel hundreds of times: minutes
        under the interpreter. The unshrunk failing Case is reported instead.
        """
        limit = settings.default.max_examples
        phases = settings.default.phases
        if _interpreted_own(target):
            limit = min(limit, INTERPRETER_EXAMPLES)
            phases = tuple(p for p in phases if p is not Phase.shrink)
        if cap is not None:
            limit = min(limit, cap)
        return settings(settings.default, max_examples=limit, phases=phases)


_SESSION = pytest.StashKey[Session]()


def session_of(config: pytest.Config) -> Session:
    if _SESSION not in config.stash:
        chosen = selection(config)
        dtypes = tuple(parse_dtype(d) for d in ((chosen.dtype,) if chosen.dtype is not None
                                               else default_dtypes(chosen.device)))
        resolved = config.stash.get(RESOLVED, None)  # the plugin's --attnlab-kernel in --attnlab-convention
        if resolved is None and chosen.kernel is not None:
            resolved = resolve_in_convention(chosen.kernel, chosen.formulation, chosen.convention_or_default,
                                             dtype=dtypes[0], device=chosen.device)
        if resolved is not None:
            if resolved.target is None:
                raise ValueError(resolved.detection_text)
            targets: tuple[Target, ...] = (resolved.target,)
        else:
            targets = tuple(own_kernel_targets([chosen.formulation] if chosen.formulation else None))
        config.stash[_SESSION] = Session(chosen, targets, dtypes)
    return config.stash[_SESSION]



# The properties whose failures grow with the sequence: the ones the long-sequence GPU test runs.
LONG_SEQUENCE_PROPERTIES = ("matches_oracle", "overflow", "split_and_resume", "backward_matches_oracle")
