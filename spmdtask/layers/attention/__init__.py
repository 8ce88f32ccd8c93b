"""Attention: the layer (`mha`), the fused kernels it picks among (`fused`), and attention
over a sequence split across mesh axes (`context`, with its block kernels `xla_blocks`,
`splash_blocks`, `splash_gathered`)."""
