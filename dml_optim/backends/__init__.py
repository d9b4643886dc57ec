"""How a flat buffer's rule runs, behind one interface (:class:`~dml_optim.backends.base.Backend`:
``supports``, ``plan``, ``run``), and the one place that chooses between the backends.

* :mod:`~dml_optim.backends.base`: the interface, the step request and the plans (named types), the
  per-buffer runtime record (the decision, each backend's cache);
* :mod:`~dml_optim.backends.choose`: the decision, once per (buffer, structural settings); ``plan_step``,
  ``run_plan``, ``resolved_backend``;
* :mod:`~dml_optim.backends.eager`: DirectML's path, the op chain of :mod:`dml_optim.core.functional`;
* :mod:`~dml_optim.backends.compiled` (with :mod:`~dml_optim.backends.direct` and
  :mod:`~dml_optim.backends.inductor`): one ``torch.compile``'d kernel per class;
* :mod:`~dml_optim.backends.fused`: torch's own fused CPU kernels on the flat buffers;
* :mod:`~dml_optim.backends.modes`: a dynamo trace or dispatch mode in progress.

May import: core.
"""
