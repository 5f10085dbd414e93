"""KV as ragkv keeps it: the entry (`entry`: each layer group's canonical tensor and a recurrent
layer's state) and its conversion to and from transformers' cache (`cache`, `ragged`), each
model's cache layout (`layout`) and what vLLM's connector moves of it (`movable`), how it is
stored (`codec`), moved to other positions (`rope`) and keyed in sequences (`spans`). Above the
core; below the model code."""
