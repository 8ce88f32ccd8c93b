"""Objectives besides the model's own LM loss (`spmdtask.core.objective.Objective`): DPO,
GRPO (with its rewards, registered by name). Imports: core and the shared modules only."""
