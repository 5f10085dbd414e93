"""How several chunks' KV becomes one prompt's cache: exact assembly, the in-process cache of
assembled prefixes, the approximate modes (selective recompute, APE scaling), the attention
probe they use, and what calibration chose. Above the model code."""
