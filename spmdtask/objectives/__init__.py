"""What a step minimizes besides the LM loss (DPO, GRPO), and GRPO's rewards.

Imports: core and the top-level shared modules only.
"""
