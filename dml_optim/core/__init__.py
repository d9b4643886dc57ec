"""The rules and their storage: the lowest layer.

* :mod:`~dml_optim.core.functional`: the update rules as pure functions over tensors (the math, once);
* :mod:`~dml_optim.core.update`: one update of one range of a flat buffer, for every backend and precision mode;
* :mod:`~dml_optim.core.flat`: a param group packed into flat buffers, with parameters, gradients and states as views
  (its gradient side in :mod:`~dml_optim.core.grads`, its binding checks in :mod:`~dml_optim.core.bindings`);
* :mod:`~dml_optim.core.dtypes`: the dtype rules of the precision options, step limits and ranges;
* :mod:`~dml_optim.core.packing`: parameters on their way into a flat buffer (distributed tensors, packing);
* :mod:`~dml_optim.core.quant`: block-quantized (8-bit and 4-bit) storage of states;
* :mod:`~dml_optim.core.steps`: step counts, kept as classes of parameters that step together;
* :mod:`~dml_optim.core.options`: constants and the runtime options every optimizer takes;
* :mod:`~dml_optim.core.opcount`: the one hook that counts the ops a piece of code dispatches;
* :mod:`~dml_optim.core.rounding`: stochastic rounding of float32 into float16/bfloat16;
* :mod:`~dml_optim.core.tracing`: whether dynamo traces the caller (the one test of it).

Nothing here knows torch.optim, a backend or an optimizer class.

May import: nothing of dml_optim outside core.
"""
