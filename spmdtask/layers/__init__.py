"""Model families and their layers: attention (fused: cuDNN / splash), RoPE, the block, the
scanned stack, the Llama-style TransformerLm and the ViT. Each model implements
`spmdtask.core.model`'s contract; the framework never imports this package (configs/ do).

Imports: core and the top-level shared modules.
"""
