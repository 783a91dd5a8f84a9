"""attnlab: a numerical-analysis and property-testing lab for attention and its linear variants.

Public contract (DESIGN.md)::

    import attnlab
    attnlab.names()                        # the ten formulations, in FORMULATIONS.md's order
    f = attnlab.formulation("deltanet")    # the registry entry
    x = f.sample(B=1, T=64, H=2, K=16, V=16, seed=0)
    o = attnlab.oracle("deltanet", form="chunkwise", precision="float64", chunk_size=16)(**x)
    o = attnlab.oracle("deltanet", form="recurrent", precision="mpmath", dps=50)(**x)
    o = attnlab.kernel("deltanet", form="chunkwise")(**{n: t.cuda().half() for n, t in x.items()})
"""

from attnlab.kernel import kernel
from attnlab.oracle import oracle
from attnlab.registry import REGISTRY, formulation, names
from attnlab.spec import FORMS

__version__ = "0.1.0"

__all__ = ["names", "formulation", "oracle", "kernel", "REGISTRY", "FORMS", "__version__"]

