"""KV as ragkv keeps it: the canonical tensor and its conversion to and from transformers' cache
(`cache`), each model's cache layout (`layout`), how it is stored (`codec`), moved to other
positions (`rope`) and keyed in sequences (`spans`). Above the core; below the model code."""
