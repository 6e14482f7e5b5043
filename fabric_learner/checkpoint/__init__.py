"""Checkpoint formats: single files (``files``), sharded DCP folders (``dcp_folder``), the checks
every load path shares (``validate``) and the Trainer's resume on another number of ranks
(``resize``), and the Learner's checkpoint methods (``learner``: ``LearnerCheckpoints``, a base of
``Learner``). Learners and the Trainer call into here; nothing here imports them."""
