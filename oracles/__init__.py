"""Float64 (torch) and mpmath oracles: one module per formulation, each with
the three forms ``recurrent``, ``parallel`` and ``chunkwise``.

Every form has the signature ``form(xp, **inputs, **options, state=..., ...)``
and returns ``(o, final_state_parts)``; use them through
:func:`attnlab.oracle`, which validates inputs and picks the backend ``xp``.
"""
