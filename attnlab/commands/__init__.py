"""The commands a user runs (``attnlab report``, ``map``, ``validate``, ``selftest``, ``bench``, ``campaign``).

They sit above every other layer: they may import the spine (spec, registry, oracles, kernels, metrics,
conventions) and the property library, and nothing below imports them. attnlab.cli and the pytest plugin
sit above them.
"""
