"""Triton kernels, one module per formulation (fp16/bf16/fp32 in, fp32 accumulation).

Use them through :func:`attnlab.kernel`, which validates inputs before any
launch. Each module provides a function per form it implements
(``chunkwise``, ``recurrent``), called with keyword arguments:

- the formulation's tensors (contiguous, one dtype, one device) and its
  options (``scale`` already resolved to a float, ``causal``, ...);
- for formulations with a state: ``state`` (a tuple of fp32 tensors in the
  registry's state layout, or None for the zero state) and ``return_state``;
- the module's own tunables, declared in ``OPTIONS[form]`` as
  ``name -> (default, allowed values or None)``.

It returns ``(o, final_state_parts)``: ``o`` in the input dtype with the
registry's output layout, ``final_state_parts`` a tuple of fp32 tensors when
``return_state`` is set, else None.
"""
