"""Conformance: one LightningModule under HPPStrategy and under one process with Lightning's default
strategy, for each Lightning behaviour, compared on every rank.

* :mod:`tests.conformance.harness`: the layouts, the per-scenario context (Trainer, loaders, strategy
  for each layout), what every rank records;
* :mod:`tests.conformance.scenarios`: the models and one scenario per behaviour;
* :mod:`tests.conformance.worker`: one job per layout runs every scenario one after another;
* :mod:`tests.conformance.compare`: the assertions the tests share.
"""
