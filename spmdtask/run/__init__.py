"""A job on its devices: the train loop, checkpoints (canonical orbax), evaluation, KV-cache
decoding, TensorBoard summaries, Ctrl-C / SIGTERM, and joining a multi-process job (`cluster`).

Imports: core, `task`, `plan.chips` (the MFU peak of the chip) and the top-level shared
modules; a program reaches run/ through
`spmdtask.core.program`'s contract, never by strategy.
"""
