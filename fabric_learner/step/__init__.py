"""What one update does, whatever the backend: the pieces ``Learner.update`` is made of.

``carrier`` (a TensorDict batch through Fabric's module wrapper, the loss run on it), ``output`` (reading
a torchrl loss output: its loss entries and their sum), ``stages`` and ``staged`` (several optimizers and
the step that trains them), ``parts`` (what the single-optimizer and the staged step share), ``compile``
(``compile=True``), ``rng`` (the random state an update draws from) and ``sample_counts`` (every rank fed
each step the same number of samples). Nothing here launches a process or picks a placement; importing
this package imports none of its modules.
"""
