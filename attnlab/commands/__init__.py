"""The commands a user runs (``attnlab report``, ``map``, ``validate``, ``selftest``, ``bench``, ``campaign``).

They sit above every other layer: they may import the spine (spec, registry, oracles, kernels, metrics,
conventions) and the property library, and nothing below imports them. attnlab.cli and the pytest plugin
sit above them.

Every command exits 0 when it did what was asked, 1 when a result failed and 2 on a usage error.
"""

import sys

EXIT_HELD, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def usage_error(command: str, message: str) -> int:
    """Print ``attnlab COMMAND: error: MESSAGE`` (argparse's form) to stderr; return the usage exit status."""
    print(f"attnlab {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE
