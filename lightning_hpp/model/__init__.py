"""The user's model as pipeline units: where it can be cut and how a cut is checked.

``units``: the units of a LightningModule and the stand-in for a unit held by another rank;
``sequential``: the check that ``forward`` is the units applied in order (the sequential frontend).
"""
