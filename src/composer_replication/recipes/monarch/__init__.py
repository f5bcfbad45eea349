"""The Monarch placement (``[roles] placement = "monarch"``, ``train --placement monarch``;
formerly ``[engine] type`` / ``--engine``): the run's
Sampler, Grader, Learner and Teacher roles as Monarch actors on process meshes
(:mod:`.actors`), driven by the native loop's controller (:mod:`.engine`). Needs the
``monarch`` extra (``torchmonarch``); nothing here is imported by the core package."""
