"""Writing and resuming ckptfmt checkpoints from training frameworks, one module per framework.

===================================  ==================================================================
module                               what
===================================  ==================================================================
``ckptfmt.integrations.hf``          ``CkptfmtCallback``: a ckptfmt checkpoint at each HF Trainer save;
                                     ``prepare_resume`` for ``trainer.train(resume_from_checkpoint=)``
``ckptfmt.integrations.lightning``   ``CkptfmtCheckpointIO``: Lightning saves and resumes through ckptfmt
``ckptfmt.integrations.accelerate``  ``save_state``/``load_state`` of an ``Accelerator`` through ckptfmt
===================================  ==================================================================

Each module imports its framework; this package imports nothing, and ``import ckptfmt`` does not
import it. Install the frameworks with the ``integrations`` extra.
"""
