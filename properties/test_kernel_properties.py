"""Every kernel property (attnlab.properties.suite) on every selected target and dtype.

On the CPU attnlab's kernels run under the Triton interpreter at small
sizes with a few examples each; the ``gpu`` test draws long sequences.
Select with the plugin's options (attnlab.pytest_plugin).
"""

from __future__ import annotations

import pytest
import torch

from attnlab.properties.session import LONG_SEQUENCE_EXAMPLES, Session
from attnlab.properties.strategies import GPU_LONG_SIZES
from attnlab.properties.suite import KernelProperty, search
from attnlab.properties.targets import Target


def test_kernel_property(kernel_property: KernelProperty, target: Target, dtype: torch.dtype,
                         attnlab_session: Session) -> None:
    search(kernel_property, target, dtype, attnlab_session.device, attnlab_session.sizes,
           attnlab_session.settings_for(target))()


@pytest.mark.gpu
@pytest.mark.long_sequences
def test_kernel_property_long_sequences(kernel_property: KernelProperty, target: Target, dtype: torch.dtype,
                                        attnlab_session: Session) -> None:
    search(kernel_property, target, dtype, attnlab_session.device, GPU_LONG_SIZES,
           attnlab_session.settings_for(target, cap=LONG_SEQUENCE_EXAMPLES))()
