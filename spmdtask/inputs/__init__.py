"""Data feeds: synthetic data, tf.data TFRecords, packed text corpora, tokenizers, prompts,
images. Every input implements `spmdtask.core.host_input`'s contract (a process's share of
the global batch, a restorable position).

Imports: core and the top-level shared modules.
"""
