"""Hydra finds plugins only in the ``hydra_plugins`` namespace: this registers the study sweeper of
:mod:`lightning_hpp.hydra.study` as ``hydra/sweeper=lightning_hpp``."""

from hydra.core.config_store import ConfigStore

from lightning_hpp.hydra.study import StudySweeper as _StudySweeper
from lightning_hpp.hydra.study import StudySweeperConf


class StudySweeper(_StudySweeper):
    """:class:`lightning_hpp.hydra.study.StudySweeper`, under the name Hydra accepts for a plugin."""


ConfigStore.instance().store(
    group="hydra/sweeper", name="lightning_hpp", node=StudySweeperConf, provider="lightning_hpp"
)
