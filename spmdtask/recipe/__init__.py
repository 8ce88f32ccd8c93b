"""One recipe file, one command: `python -m spmdtask.recipe --recipe=FILE.toml`.

A recipe (TOML) names the model, the root dir, the stages in order and the export:

    root = "runs/chat"                       # every job dir goes under it
    [model]
    hf = "examples/tiny_chat/model"          # imported into ROOT/import (or: job = IMPORT_DIR)
    [[stage]]
    kind = "sft"                             # sft, dpo or grpo
    input = "examples/tiny_chat/conversations.jsonl"   # raw file, prepared into ROOT/sft_data
    max_len = 65                             # the prepare tool's --max_len (input only;
                                             # grpo: --max_prompt_len, optional)
    lora_rank = 8                            # omit: every param trains
    fdl_set = ["task.train.num_train_steps=20"]
    [[stage]]
    kind = "dpo"
    data = "DIR"                             # or a prepared data dir
    [[stage]]
    kind = "grpo"
    input = "prompts.jsonl"                  # {"prompt": ..., "answer": ...} a line
    reward = ["my_rewards.py:exact:1.0"]     # --reward values (registered names too)
    [export]
    hf = "export"                            # the last stage's model, merged (HF format)
    adapter = "adapter"                      # a LoRA last stage's adapter (PEFT format)

Relative paths are the recipe file's dir's, the export's ROOT's (`--root=DIR` replaces the
recipe's root). Each stage runs `python -m spmdtask.main --exp=stages.<Kind> --job_log_dir=ROOT/<name>
--init_from=<the stage before, or the import> ...` as a subprocess, printed first so it
stays runnable by hand; a stage whose job reached its last step (its `stage_done` file) is
skipped, an interrupted one resumes (the same command resumes from its checkpoint). A
stage's `name` (default its kind) names its job dir. A bad key is exit 2 naming the key and
its line; nothing runs before the whole recipe is checked.

recipe_file.py reads and checks the file; runner.py turns it into commands and runs them.
Imports: the shared top level only (errors, fs); the stages run as subprocesses, so the
recipe sits above main without importing it.
"""
