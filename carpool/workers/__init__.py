"""The device workers: what runs a generation engine's steps with torch.

``carpool.engine`` is the torch-free core (scheduler, block manager, engine,
sequences, sampling parameters, speculation's bookkeeping); it is handed a runner
through ``engine.runner.Runner``. Here are the runners, one per device kind
(``model_runner`` for the CPU, ``cuda_runner`` with ``decode_graphs`` for a GPU), what
they share (``step_tensors``, ``sampler``), and ``factory.engine_for``, which picks
one: a runner never builds another.
"""
