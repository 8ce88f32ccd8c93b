"""Objectives besides the model's own LM loss (`spmdtask.core.objective.Objective`): DPO."""
