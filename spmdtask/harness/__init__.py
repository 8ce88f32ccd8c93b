"""EleutherAI's lm-evaluation-harness on the mesh (`--mode=lm_eval`): `programs` (token rows
scored and continued by a checkpoint's params on the job's mesh: decode's programs and one
forward of the model), `backend` (spmdtask as an `lm_eval` model: requests into those
programs' batches), `tasks` (finding the tasks, running them, writing the results),
`command` (the mode's flags and the job's tokenizer and chat template) and `training` (the
same tasks every N steps of --mode=train, on the live params: a train-loop hook).

Imports: `run` (decoding, checkpoints, summaries), core, `task`, `inputs` (the chat
template, through `command` only) and the shared modules; lm-eval itself is imported only
when the mode runs (never at `import spmdtask`).
"""
