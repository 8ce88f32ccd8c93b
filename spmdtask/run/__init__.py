"""A job on its devices: the train loop, checkpoints (canonical orbax), evaluation, KV-cache
decoding, TensorBoard summaries, Ctrl-C / SIGTERM, joining a multi-process job (`cluster`),
one training per job dir (`joblock`) and a lost process stopping the others (`peers`).

Imports: core, `task`, `plan.chips` (the MFU peak of the chip) and the top-level shared
modules; a program reaches run/ through
`spmdtask.core.program`'s contract, never by strategy.
"""
