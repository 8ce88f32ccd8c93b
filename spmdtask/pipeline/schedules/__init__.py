"""Pipeline schedules as data: per-stage ordered actions F, B, I, W on (microbatch, chunk).

`schedule` (the format, its text form, the dependencies and the one execution-order engine
that validates), `generators` and `generators_v` (GPipe, 1F1B, interleaved, ZB-H1, ZB-V,
DualPipeV), `files` and `torch_csv` (spmdtask's text and torch's CSV), `simulate` (time line,
bubble, live activations) and `balance` (contiguous layer cuts that minimise the slowest
stage). Pure Python: no JAX, no devices.

Imports: the top-level shared modules (`errors`, `fs`) only.
"""
