"""The main job: the built-in data and model (:mod:`~dml_optim.job.toy`) and the trainer behind
``dml-optim train`` (:mod:`~dml_optim.job.train`).

May import: core, dml, backends, optimizers, training, standin, top.
"""
