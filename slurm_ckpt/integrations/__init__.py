"""Drop-ins for the trainers people use; each module needs its framework installed.

* :mod:`slurm_ckpt.integrations.lightning` (``pip install slurm-ckpt[lightning]``):
  ``SlurmCkptIO``, a Lightning ``CheckpointIO``, and ``PreemptionCallback``.
* :mod:`slurm_ckpt.integrations.transformers` (``slurm-ckpt[hf]``): ``SlurmCkptCallback``
  for ``transformers.Trainer``.
* :mod:`slurm_ckpt.integrations.accelerate` (``slurm-ckpt[hf]``): ``save_state`` and
  ``load_state`` for an ``accelerate.Accelerator``.

Nothing here is imported by ``import slurm_ckpt``: each framework is imported
only by its own module. Those three modules are public, each with its
``__all__``; the modules whose names start with ``_`` are internal.
"""

from __future__ import annotations

__all__: list[str] = []
